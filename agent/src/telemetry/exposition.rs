//! The exposition format a scraper gets: OpenMetrics (with exemplars) when it asks for it, the
//! Prometheus text format (0.0.4) otherwise.
//!
//! ```text
//! GET /metrics, Accept: application/openmetrics-text... ─> OpenMetrics, exemplars on latencies
//! GET /metrics, anything else ──────────────────────────> Prometheus text 0.0.4, no exemplars
//! ```
//!
//! prometheus-client writes only OpenMetrics, so the Prometheus text is derived from it line by
//! line: the two formats differ only in what is rewritten here (exemplars, `# EOF`, `# UNIT`,
//! and the metadata of counters and info metrics, which OpenMetrics names without the sample
//! suffix). Old scrapers and `curl` users get a text every Prometheus parser accepts.

/// Whether an `Accept` header asks for OpenMetrics (Prometheus does so by default; an explicit
/// `q=0` refusal is honoured).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|accept| {
        accept.split(',').any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or_default();
            let refused = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f64>().ok())
                    .is_some_and(|q| q <= 0.0)
            });
            media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
        })
    })
}

/// Rewrites OpenMetrics text (as prometheus-client writes it) into the Prometheus text format.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // OpenMetrics writes HELP before TYPE; the HELP's name depends on the type.
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (suffix, kind) = match kind {
                "counter" => ("_total", "counter"),
                "info" => ("_info", "gauge"),
                "gauge" | "histogram" | "summary" => ("", kind),
                _ => ("", "untyped"),
            };
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name}{suffix} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name}{suffix} {kind}\n"));
            continue;
        }
        if let Some((help_name, text)) = help.take() {
            out.push_str(&format!("# HELP {help_name} {text}\n"));
        }
        out.push_str(without_exemplar(line));
        out.push('\n');
    }
    out
}

/// A sample line without its exemplar (` # {...} value [timestamp]` after the value). Label
/// values may hold ` # ` themselves, so the label set is skipped quote by quote first.
fn without_exemplar(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut i = 0;
    let mut in_quotes = false;
    let mut in_labels = false;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' if in_quotes => i += 1,
            b'"' if in_labels => in_quotes = !in_quotes,
            b'{' if !in_quotes => in_labels = true,
            b'}' if !in_quotes => in_labels = false,
            b' ' if !in_labels && line[i..].starts_with(" # ") => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENMETRICS: &str = "\
# HELP plugin_agent_operations Operations.
# TYPE plugin_agent_operations counter
plugin_agent_operations_total{kind=\"register\",outcome=\"success\"} 1
# HELP plugin_agent_registration_duration_seconds Latency.
# TYPE plugin_agent_registration_duration_seconds histogram
plugin_agent_registration_duration_seconds_bucket{source=\"ebpf\",le=\"0.005\"} 1 # {trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\",span_id=\"00f067aa0ba902b7\"} 0.003 1700000000.5
plugin_agent_registration_duration_seconds_bucket{source=\"ebpf\",le=\"+Inf\"} 1
# HELP plugin_manager_total_plugins Plugins.
# TYPE plugin_manager_total_plugins gauge
plugin_manager_total_plugins{socket_path=\"/r/a # {b}\\\" # c.sock\",state=\"desired_state_of_world\"} 1
# HELP plugin_agent_build The build.
# TYPE plugin_agent_build info
plugin_agent_build_info{version=\"0.1.0\"} 1
# EOF
";

    #[test]
    fn prometheus_text_has_no_exemplars_no_eof_and_suffixed_metadata() {
        let text = to_prometheus_text(OPENMETRICS);
        assert!(!text.contains("trace_id"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(text.contains("# TYPE plugin_agent_operations_total counter\n"));
        assert!(text.contains("# HELP plugin_agent_operations_total Operations.\n"));
        assert!(text.contains("# TYPE plugin_agent_build_info gauge\n"));
        assert!(text.contains(
            "plugin_agent_registration_duration_seconds_bucket{source=\"ebpf\",le=\"0.005\"} 1\n"
        ));
        // A label value that looks like an exemplar is left alone.
        assert!(
            text.contains("socket_path=\"/r/a # {b}\\\" # c.sock\""),
            "{text}"
        );
    }

    #[test]
    fn openmetrics_is_served_only_to_scrapers_that_ask_for_it() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
    }
}
