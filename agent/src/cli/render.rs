//! Output helpers shared by the admin subcommands: structured output (JSON, YAML), aligned
//! tables, and timestamps.

use super::Output;
use std::time::{Duration, UNIX_EPOCH};

pub(super) fn timestamp(unix_ms: i64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(unix_ms.max(0) as u64))
        .to_string()
}

pub(super) fn print_structured<T: serde::Serialize>(
    value: &T,
    output: Output,
) -> anyhow::Result<()> {
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
        Output::Yaml => print!("{}", serde_norway::to_string(value)?),
        Output::Table => unreachable!("tables are printed by each command"),
    }
    Ok(())
}

pub(super) fn print_table<const N: usize>(header: &[&str; N], rows: &[[String; N]]) {
    // Cells hold what plugins announce: no control character reaches the terminal.
    let rows: Vec<[String; N]> = rows
        .iter()
        .map(|row| {
            row.clone()
                .map(|cell| crate::text::escape(&cell).into_owned())
        })
        .collect();
    let rows = rows.as_slice();
    let mut widths: [usize; N] = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}
