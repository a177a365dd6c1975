//! Findings the check knows and lets pass for now, each with the issue that removes it: a
//! ratchet. A finding matched here is printed as a debt instead of failing lint; a debt that no
//! longer matches any finding fails lint until it is taken off, so the list can only shrink, and
//! a new finding is never hidden by an old entry (an entry names its finding's file, item and
//! kind, not a pattern).

/// One known finding.
pub struct Debt {
    /// Every word of it occurs in the finding (paths, item names and the kind of problem, not
    /// line numbers or counts, which move as the code is edited).
    pub finding: &'static str,
    /// Why it is still here and what removes it.
    pub why: &'static str,
}

/// Where this list is, for the message that asks to shorten it.
pub const LIST: &str = "xtask/src/architecture/debts.rs";

pub const DEBTS: &[Debt] = &[];

/// Each check's findings, as `Survey::findings` lists them.
pub type Findings = Vec<(&'static str, Vec<String>)>;

impl Debt {
    /// Whether `finding` is this debt.
    pub fn matches(&self, finding: &str) -> bool {
        self.finding
            .split_whitespace()
            .all(|word| finding.contains(word))
    }
}

/// Splits `findings` into those that fail and those that are known debts; a debt matching none
/// fails, asking for its removal.
pub fn settle<'a>(
    findings: &'a Findings,
    debts: &'a [Debt],
) -> (Findings, Vec<(&'a str, &'a Debt)>) {
    let mut failing = Vec::new();
    let mut known = Vec::new();
    for (check, problems) in findings {
        let mut left = Vec::new();
        for problem in problems {
            match debts.iter().find(|debt| debt.matches(problem)) {
                Some(debt) => known.push((problem.as_str(), debt)),
                None => left.push(problem.clone()),
            }
        }
        failing.push((*check, left));
    }
    let paid: Vec<String> = debts
        .iter()
        .filter(|debt| !known.iter().any(|(_, d)| std::ptr::eq(*d, *debt)))
        .map(|debt| {
            format!(
                "{LIST}: the debt \"{}\" matches no finding any more: remove it from the list",
                debt.finding
            )
        })
        .collect();
    failing.push(("debts", paid));
    (failing, known)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &[Debt] = &[
        Debt {
            finding: "agent/src/watcher/mod.rs `Watcher::run` lines",
            why: "issue 47",
        },
        Debt {
            finding: "agent/src/gone.rs lines",
            why: "issue 47",
        },
    ];

    #[test]
    fn a_known_finding_passes_a_new_one_fails_and_a_paid_debt_asks_to_be_removed() {
        let findings = vec![(
            "sizes",
            vec![
                "agent/src/watcher/mod.rs:124: `Watcher::run` is 112 lines of code".to_string(),
                "agent/src/watcher/mod.rs:300: `Watcher::other` is 90 lines of code".to_string(),
            ],
        )];
        let (failing, known) = settle(&findings, TWO);
        assert_eq!(known.len(), 1);
        assert_eq!(failing[0].1, vec![findings[0].1[1].clone()]);
        assert_eq!(failing[1].0, "debts");
        assert_eq!(failing[1].1.len(), 1);
        assert!(failing[1].1[0].contains("agent/src/gone.rs"));
    }
}
