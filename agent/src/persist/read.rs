//! Reading the state files back at start: the snapshot parsed (its format and tree checked
//! first), then the journal's lines replayed over it. Anything unreadable is a warning and
//! yields nothing, so every plugin found is registered again.

use super::files::read_own_file;
use super::format::{Entry, FORMAT, Op, StateFile};
use anyhow::Context;
use std::collections::HashMap;
use std::path::Path;

/// The entries the files hold, by path, and the journal's line count when both were read
/// whole.
pub(super) fn read(
    snapshot: &Path,
    journal: &Path,
    root: &Path,
) -> (HashMap<String, Entry<'static>>, Option<usize>) {
    let bytes = match read_own_file(snapshot) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(state_file = %snapshot.display(), "no state file: registering every plugin found");
            return (HashMap::new(), None);
        }
        Err(e) => {
            tracing::warn!(state_file = %snapshot.display(), error = %e, "cannot read the state file: registering every plugin found");
            return (HashMap::new(), None);
        }
    };
    let mut entries: HashMap<String, Entry<'static>> = match parse(&bytes, root) {
        Ok(entries) => entries
            .into_iter()
            .map(|e| (e.path.clone().into_owned(), e))
            .collect(),
        Err(e) => {
            tracing::warn!(state_file = %snapshot.display(), error = format!("{e:#}"), "ignoring the state file: registering every plugin found");
            return (HashMap::new(), None);
        }
    };
    drop(bytes);
    let log = match read_own_file(journal) {
        Ok(log) => log,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            tracing::warn!(journal = %journal.display(), error = %e, "cannot read the journal: its plugins are registered again");
            // Not read whole: the files are written afresh once the start has restored.
            return (entries, None);
        }
    };
    let replayed = replay(&log, &mut entries);
    if replayed.torn > 0 {
        tracing::warn!(journal = %journal.display(), lines = replayed.torn, "skipped unreadable journal lines (a kill mid-write?): their plugins are registered again");
    }
    // A torn line, or a last line without its newline, would run into the next one appended.
    let whole = replayed.torn == 0 && log.last().is_none_or(|b| *b == b'\n');
    (entries, whole.then_some(replayed.lines))
}

/// How many journal lines were applied, and how many could not be read.
struct Replayed {
    lines: usize,
    torn: usize,
}

/// Applies journal lines to `entries`.
fn replay(journal: &[u8], entries: &mut HashMap<String, Entry<'static>>) -> Replayed {
    let mut replayed = Replayed { lines: 0, torn: 0 };
    for line in journal.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice::<Op>(line) {
            Ok(Op::Begin(entry) | Op::Add(entry)) => {
                entries.insert(entry.path.clone().into_owned(), *entry);
            }
            Ok(Op::Done { path, generation }) => {
                if let Some(entry) = entries
                    .get_mut(&path)
                    .filter(|e| e.generation == generation)
                {
                    entry.unfinished = false;
                }
            }
            Ok(Op::Remove { path, generation }) => {
                if entries
                    .get(&path)
                    .is_some_and(|e| e.generation == generation)
                {
                    entries.remove(&path);
                }
            }
            Err(_) => {
                replayed.torn += 1;
                continue;
            }
        }
        replayed.lines += 1;
    }
    replayed
}

fn parse(bytes: &[u8], root: &Path) -> anyhow::Result<Vec<Entry<'static>>> {
    // The format first, alone: a later format may change everything else.
    #[derive(serde::Deserialize)]
    struct Format {
        format: u32,
    }
    let Format { format } = serde_json::from_slice(bytes).context("not a state file")?;
    anyhow::ensure!(
        format == FORMAT,
        "format {format}, this agent reads format {FORMAT}"
    );
    let file: StateFile = serde_json::from_slice(bytes).context("malformed state file")?;
    anyhow::ensure!(
        Path::new(&file.root) == root,
        "it is for {}, this agent watches {}",
        file.root,
        root.display()
    );
    Ok(file.plugins)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn corrupt_foreign_and_other_tree_files_restore_nothing_and_say_why() {
        let root = Path::new("/plugins");
        let good = serde_json::to_vec(&StateFile {
            format: FORMAT,
            root: "/plugins".into(),
            plugins: Vec::new(),
        })
        .expect("json");
        let cases: [(&[u8], &str); 5] = [
            (b"", "not a state file"),
            (b"{\"format\": 1, \"root\": ", "not a state file"),
            (b"{\"format\": 99, \"plugins\": 7}", "format 99"),
            (
                b"{\"format\": 1, \"root\": \"/plugins\", \"plugins\": 7}",
                "malformed",
            ),
            (&good[..good.len() / 2], "not a state file"),
        ];
        for (bytes, why) in cases {
            let error = format!("{:#}", parse(bytes, root).expect_err("refused"));
            assert!(error.contains(why), "{why}: {error}");
        }
        let error = format!(
            "{:#}",
            parse(&good, Path::new("/other")).expect_err("refused")
        );
        assert!(error.contains("this agent watches /other"), "{error}");
    }
}
