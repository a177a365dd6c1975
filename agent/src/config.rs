//! The configuration file (`plugin-agent run --config FILE`), TOML. Every setting can also be
//! given on the command line, which wins; handlers from both are merged (the command line wins
//! for a type given in both). `deploy/plugin-agent.toml` is a commented sample.
//!
//! ```toml
//! plugin_dir = "/var/lib/kubelet/plugins_registry"
//! source = "auto"                 # auto | ebpf | fanotify | inotify
//! admin_socket = "/run/plugin-agent/agent.sock"
//! mode = "register"               # register | observe (no handler configured: observe)
//! observe_contact = "after-kubelet" # observe mode: after-kubelet | get-info | never
//!
//! [handlers]                      # plugin type = accept-all | unix:///path.sock | http://host:port
//! CSIPlugin = "unix:///run/csi-handler.sock"
//!
//! [timeouts]
//! validate = "45s"
//!
//! [[policy]]                      # who may register what (see `policy`); SIGHUP re-reads it
//! type = "CSIPlugin"
//! name = "*.csi.example.com"
//! allow_uids = [0]
//! ```

use crate::policy::RuleFile;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The file's contents; every field is optional.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Registration directory.
    pub plugin_dir: Option<PathBuf>,
    /// `auto`, `ebpf`, `fanotify` or `inotify`.
    pub source: Option<String>,
    /// `event` or `polling`.
    pub reconcile_mode: Option<String>,
    /// Safety pass period, e.g. `"30s"`.
    #[serde(default, with = "humantime_serde")]
    pub safety_period: Option<Duration>,
    /// Operations running at once.
    pub max_concurrent: Option<usize>,
    /// eBPF ring buffer size in bytes.
    pub ring_buffer_bytes: Option<usize>,
    /// Pin the eBPF programs in bpffs so the next agent adopts them (default true).
    pub ebpf_pins: Option<bool>,
    /// Admin API socket path.
    pub admin_socket: Option<PathBuf>,
    /// Prometheus metrics and health endpoints address, e.g. `"127.0.0.1:9464"`.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// OTLP/gRPC trace collector, e.g. `"http://127.0.0.1:4317"`.
    pub otlp_endpoint: Option<String>,
    /// `register` or `observe` (default: `register` with a handler configured, else `observe`).
    pub mode: Option<String>,
    /// In observe mode: `get-info` (default) or `never`.
    pub observe_contact: Option<crate::mode::Contact>,
    /// Register every plugin again after a restart, as kubelet does, instead of carrying on
    /// from the state file (for handlers that keep no state of their own across restarts).
    pub reregister_on_restart: Option<bool>,
    /// Handlers by plugin type.
    #[serde(default)]
    pub handlers: BTreeMap<String, String>,
    /// Deadlines.
    #[serde(default)]
    pub timeouts: TimeoutsFile,
    /// Look up who created and serves each socket in `/proc` (default true; see `provenance`).
    pub provenance: Option<bool>,
    /// Who may register what (`[[policy]]` tables; see `policy`).
    #[serde(default)]
    pub policy: Vec<RuleFile>,
}

/// Where the policy comes from: the configuration file's `[[policy]]` rules (read again on
/// every reload), then the rule the command line's flags make, last.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicySource {
    pub file: Option<PathBuf>,
    pub flag_rule: Option<RuleFile>,
}

impl PolicySource {
    /// The rules in force now; a file that cannot be read or parsed is an error naming the
    /// file, the line and the column.
    pub fn rules(&self) -> anyhow::Result<Vec<RuleFile>> {
        let mut rules = match &self.file {
            Some(file) => ConfigFile::load(file)?.policy,
            None => Vec::new(),
        };
        rules.extend(self.flag_rule.clone());
        Ok(rules)
    }
}

/// `[timeouts]`: kubelet's defaults apply to what is left out.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TimeoutsFile {
    /// Dialling a plugin (10 s).
    #[serde(default, with = "humantime_serde")]
    pub dial: Option<Duration>,
    /// GetInfo (1 s).
    #[serde(default, with = "humantime_serde")]
    pub get_info: Option<Duration>,
    /// NotifyRegistrationStatus (5 s).
    #[serde(default, with = "humantime_serde")]
    pub notify: Option<Duration>,
    /// Handler ValidatePlugin (45 s).
    #[serde(default, with = "humantime_serde")]
    pub validate: Option<Duration>,
    /// Handler RegisterPlugin (45 s).
    #[serde(default, with = "humantime_serde")]
    pub register: Option<Duration>,
    /// Handler DeRegisterPlugin (10 s).
    #[serde(default, with = "humantime_serde")]
    pub deregister: Option<Duration>,
}

impl ConfigFile {
    /// Reads and parses `path`; errors name the file and the problem.
    pub fn load(path: &Path) -> anyhow::Result<ConfigFile> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        ConfigFile::parse(&text).with_context(|| format!("config file {}", path.display()))
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> anyhow::Result<ConfigFile> {
        Ok(toml::from_str(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_file_parses() {
        let file = ConfigFile::parse(
            r#"
            plugin_dir = "/r"
            source = "fanotify"
            reconcile_mode = "event"
            safety_period = "1m"
            max_concurrent = 8
            admin_socket = "/run/a.sock"
            metrics_addr = "127.0.0.1:9000"
            otlp_endpoint = "http://127.0.0.1:4317"
            [handlers]
            CSIPlugin = "unix:///run/csi.sock"
            DRAPlugin = "accept-all"
            [timeouts]
            validate = "2s"
            deregister = "500ms"
            "#,
        )
        .expect("parses");
        assert_eq!(file.plugin_dir.as_deref(), Some(Path::new("/r")));
        assert_eq!(file.safety_period, Some(Duration::from_secs(60)));
        assert_eq!(
            file.handlers.get("CSIPlugin").map(String::as_str),
            Some("unix:///run/csi.sock")
        );
        assert_eq!(file.timeouts.validate, Some(Duration::from_secs(2)));
        assert_eq!(file.timeouts.deregister, Some(Duration::from_millis(500)));
        assert_eq!(file.timeouts.dial, None);
        assert_eq!(
            file.metrics_addr,
            Some("127.0.0.1:9000".parse().expect("addr"))
        );
        assert_eq!(file.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4317"));
    }

    #[test]
    fn unknown_keys_and_bad_durations_are_errors() {
        assert!(ConfigFile::parse("plugin_directory = \"/r\"").is_err());
        assert!(ConfigFile::parse("safety_period = \"soon\"").is_err());
        assert!(ConfigFile::parse("[timeouts]\nvalidat = \"1s\"").is_err());
    }

    #[test]
    fn empty_file_is_all_defaults() {
        assert_eq!(
            ConfigFile::parse("").expect("parses"),
            ConfigFile::default()
        );
    }
}
