//! Policy: who may register what.
//!
//! kubelet registers whatever answers GetInfo, so any process that can write into the
//! registration directory can claim to be `ebs.csi.aws.com`. A policy names, per plugin type and
//! name, which processes may serve it (and, optionally, create its socket):
//!
//! ```toml
//! [[policy]]
//! id = "csi-drivers"                      # optional: the rule's name in messages and metrics
//! type = "CSIPlugin"                      # plugin type, glob; "*" (the default) for any
//! name = "*.csi.example.com"              # glob on GetInfo's name; "*" (the default) for any
//! allow_uids = [0]                        # the serving process's uid
//! allow_gids = [0]                        # the serving process's gid
//! allow_cgroups = ["/kubepods.slice/*"]   # globs on the serving process's cgroup v2 path
//! same_cgroup = true                      # the socket's creator is in the server's cgroup
//! ```
//!
//! The first rule whose type and name match decides: every condition it states must hold (a
//! condition that cannot be checked, such as the creator on a source that reports none, does not
//! hold). A plugin no rule matches is allowed, and no rule at all allows everything (kubelet's
//! behaviour); a catch-all rule last (`type = "*"`, `name = "*"`) refuses by default. A glob's
//! `*` matches any characters, `/` included, so `/kubepods.slice/*` covers every pod below it.
//!
//! This room imports only `provenance`: the executor asks it about each plugin after GetInfo,
//! and again for every registered plugin when the policy is reloaded.

use crate::provenance::{Creator, Process};
use globset::{Glob, GlobMatcher, GlobSet, GlobSetBuilder};
use std::fmt;
use std::sync::Arc;

/// One `[[policy]]` table, as written.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleFile {
    /// The rule's name in refusals, logs and the `rule` metric label (default `#N`, its place
    /// in the list from 1).
    pub id: Option<String>,
    /// Glob on the plugin type (`CSIPlugin`, `DevicePlugin`, `DRAPlugin`).
    #[serde(rename = "type", default = "any")]
    pub plugin_type: String,
    /// Glob on GetInfo's name.
    #[serde(default = "any")]
    pub name: String,
    pub allow_uids: Option<Vec<u32>>,
    pub allow_gids: Option<Vec<u32>>,
    pub allow_cgroups: Option<Vec<String>>,
    /// Require the socket's creator to be in the server's cgroup.
    #[serde(default)]
    pub same_cgroup: bool,
}

fn any() -> String {
    "*".to_string()
}

/// A compiled policy; the default allows everything.
#[derive(Debug, Default)]
pub struct Policy {
    rules: Vec<Rule>,
}

#[derive(Debug)]
struct Rule {
    label: Arc<str>,
    plugin_type: GlobMatcher,
    name: GlobMatcher,
    allow_uids: Option<Vec<u32>>,
    allow_gids: Option<Vec<u32>>,
    allow_cgroups: Option<(GlobSet, Vec<String>)>,
    same_cgroup: bool,
}

/// A plugin the policy refuses: which rule, and what did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The rule's label (the `rule` metric label).
    pub rule: Arc<str>,
    /// What did not hold.
    pub reason: String,
    /// The server, as the policy saw it.
    pub server: Option<Arc<Process>>,
}

impl fmt::Display for Refusal {
    /// `rejected by policy: csi-drivers (uid 1000 not in allow_uids [0]), served by uid 1000
    /// cgroup /user.slice/...`: what the plugin is told in NotifyRegistrationStatus.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rejected by policy: {} ({}), served by ",
            self.rule, self.reason
        )?;
        match self.server.as_deref() {
            Some(server) => {
                match server.uid {
                    Some(uid) => write!(f, "uid {uid}")?,
                    None => f.write_str("an unknown uid")?,
                }
                match server.cgroup_path() {
                    Some(path) => write!(f, " cgroup {path}"),
                    None => f.write_str(" in an unknown cgroup"),
                }
            }
            None => f.write_str("an unknown process"),
        }
    }
}

/// What the policy is asked about: the plugin GetInfo described, and its provenance.
#[derive(Debug, Clone, Copy)]
pub struct Subject<'a> {
    pub plugin_type: &'a str,
    pub name: &'a str,
    pub creator: &'a Creator,
    pub server: Option<&'a Arc<Process>>,
}

impl Policy {
    /// Compiles `rules`; an invalid glob is an error naming its rule.
    pub fn compile(rules: &[RuleFile]) -> anyhow::Result<Policy> {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(index, rule)| Rule::compile(index, rule))
            .collect::<anyhow::Result<_>>()?;
        Ok(Policy { rules })
    }

    /// Number of rules (0: everything is allowed).
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The first matching rule's verdict; `Ok` when allowed.
    pub fn check(&self, subject: Subject<'_>) -> Result<(), Refusal> {
        let Some(rule) = self
            .rules
            .iter()
            .find(|r| r.plugin_type.is_match(subject.plugin_type) && r.name.is_match(subject.name))
        else {
            return Ok(());
        };
        rule.check(subject).map_err(|reason| Refusal {
            rule: rule.label.clone(),
            reason,
            server: subject.server.cloned(),
        })
    }
}

impl Rule {
    fn compile(index: usize, file: &RuleFile) -> anyhow::Result<Rule> {
        let label: Arc<str> = match &file.id {
            Some(id) => id.as_str().into(),
            None => format!("#{}", index + 1).into(),
        };
        let glob = |pattern: &str, what: &str| {
            Glob::new(pattern)
                .map_err(|e| anyhow::anyhow!("policy rule {label}: {what} {pattern:?}: {e}"))
        };
        let allow_cgroups = match &file.allow_cgroups {
            Some(patterns) => {
                let mut set = GlobSetBuilder::new();
                for pattern in patterns {
                    set.add(glob(pattern, "allow_cgroups")?);
                }
                Some((set.build()?, patterns.clone()))
            }
            None => None,
        };
        Ok(Rule {
            plugin_type: glob(&file.plugin_type, "type")?.compile_matcher(),
            name: glob(&file.name, "name")?.compile_matcher(),
            allow_uids: file.allow_uids.clone(),
            allow_gids: file.allow_gids.clone(),
            allow_cgroups,
            same_cgroup: file.same_cgroup,
            label,
        })
    }

    /// `Err(what did not hold)`.
    fn check(&self, subject: Subject<'_>) -> Result<(), String> {
        let server = subject.server.map(|s| &**s);
        if let Some(uids) = &self.allow_uids {
            match server.and_then(|s| s.uid) {
                Some(uid) if uids.contains(&uid) => {}
                Some(uid) => return Err(format!("uid {uid} not in allow_uids {uids:?}")),
                None => return Err("the server's uid is unknown".into()),
            }
        }
        if let Some(gids) = &self.allow_gids {
            match server.and_then(|s| s.gid) {
                Some(gid) if gids.contains(&gid) => {}
                Some(gid) => return Err(format!("gid {gid} not in allow_gids {gids:?}")),
                None => return Err("the server's gid is unknown".into()),
            }
        }
        if let Some((set, patterns)) = &self.allow_cgroups {
            match server.and_then(Process::cgroup_path) {
                Some(path) if set.is_match(path) => {}
                Some(path) => {
                    return Err(format!(
                        "cgroup {path} matches no allow_cgroups {patterns:?}"
                    ));
                }
                None => return Err("the server's cgroup is unknown".into()),
            }
        }
        if self.same_cgroup {
            let Some(creator) = subject.creator.process() else {
                let why = subject.creator.unknown_because().unwrap_or("unknown");
                return Err(format!("same_cgroup: the creator is unknown ({why})"));
            };
            match server {
                Some(server) if creator.same_cgroup(server) => {}
                Some(_) => {
                    return Err(format!(
                        "same_cgroup: created by {creator}, in another cgroup than its server"
                    ));
                }
                None => return Err("same_cgroup: the server is unknown".into()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provenance::Cgroup;

    fn rules(toml_text: &str) -> Policy {
        #[derive(serde::Deserialize)]
        struct File {
            policy: Vec<RuleFile>,
        }
        let file: File = toml::from_str(toml_text).expect("parses");
        Policy::compile(&file.policy).expect("compiles")
    }

    fn process(uid: u32, cgroup: &str, id: u64) -> Arc<Process> {
        Arc::new(Process {
            pid: Some(10),
            uid: Some(uid),
            gid: Some(uid),
            command: Some("driver".into()),
            cgroup: Some(Arc::new(Cgroup {
                path: cgroup.into(),
                id: Some(id),
                pod_uid: None,
                container_id: None,
            })),
            pidfs_ino: None,
        })
    }

    fn subject<'a>(
        name: &'a str,
        creator: &'a Creator,
        server: Option<&'a Arc<Process>>,
    ) -> Subject<'a> {
        Subject {
            plugin_type: "CSIPlugin",
            name,
            creator,
            server,
        }
    }

    const ISSUE_EXAMPLE: &str = r#"
        [[policy]]
        type = "CSIPlugin"
        name = "*.csi.example.com"
        allow_uids = [0]
        allow_cgroups = ["/kubepods.slice/*"]
    "#;

    #[test]
    fn a_rule_with_several_allow_lists_needs_all_of_them() {
        let policy = rules(ISSUE_EXAMPLE);
        let pod = process(
            0,
            "/kubepods.slice/kubepods-pod1.slice/cri-containerd-a.scope",
            1,
        );
        let user = process(0, "/user.slice/session-1.scope", 2);
        let nobody = process(65534, "/kubepods.slice/x", 3);
        let walk = Creator::FoundByWalk;
        assert_eq!(
            policy.check(subject("ebs.csi.example.com", &walk, Some(&pod))),
            Ok(())
        );
        let refused = policy
            .check(subject("ebs.csi.example.com", &walk, Some(&user)))
            .expect_err("wrong cgroup");
        assert_eq!(
            refused.to_string(),
            "rejected by policy: #1 (cgroup /user.slice/session-1.scope matches no allow_cgroups \
             [\"/kubepods.slice/*\"]), served by uid 0 cgroup /user.slice/session-1.scope"
        );
        let refused = policy
            .check(subject("ebs.csi.example.com", &walk, Some(&nobody)))
            .expect_err("wrong uid");
        assert_eq!(&*refused.rule, "#1");
        assert!(
            refused.reason.contains("uid 65534 not in allow_uids"),
            "{refused}"
        );
        assert!(
            policy
                .check(subject("ebs.csi.example.com", &walk, None))
                .is_err(),
            "an unknown server satisfies no allow list"
        );
    }

    #[test]
    fn the_first_matching_rule_decides_and_unmatched_plugins_are_allowed() {
        let policy = rules(
            r#"
            [[policy]]
            id = "trusted"
            name = "trusted.example.com"
            [[policy]]
            id = "root-only"
            type = "CSI*"
            allow_uids = [0]
        "#,
        );
        let walk = Creator::FoundByWalk;
        let nobody = process(65534, "/x", 1);
        assert_eq!(
            policy.check(subject("trusted.example.com", &walk, Some(&nobody))),
            Ok(())
        );
        let refused = policy
            .check(subject("other.example.com", &walk, Some(&nobody)))
            .expect_err("second rule");
        assert_eq!(&*refused.rule, "root-only");
        let device = Subject {
            plugin_type: "DevicePlugin",
            ..subject("other.example.com", &walk, Some(&nobody))
        };
        assert_eq!(
            policy.check(device),
            Ok(()),
            "no rule matches a device plugin"
        );
        assert_eq!(Policy::default().check(device), Ok(()));
    }

    #[test]
    fn same_cgroup_needs_a_known_creator_in_the_servers_cgroup() {
        let policy = rules("[[policy]]\nsame_cgroup = true");
        let server = process(0, "/kubepods/pod1/a", 7);
        let same = Creator::Known(process(0, "/kubepods/pod1/a", 7));
        let other = Creator::Known(process(0, "/kubepods/pod2/b", 8));
        assert_eq!(policy.check(subject("a", &same, Some(&server))), Ok(()));
        let refused = policy
            .check(subject("a", &other, Some(&server)))
            .expect_err("creator elsewhere");
        assert!(refused.reason.contains("another cgroup"), "{refused}");
        let refused = policy
            .check(subject("a", &Creator::NotReported, Some(&server)))
            .expect_err("no creator");
        assert!(refused.reason.contains("inotify"), "{refused}");
    }

    #[test]
    fn bad_globs_and_unknown_keys_are_errors() {
        let bad = RuleFile {
            id: None,
            plugin_type: "*".into(),
            name: "[".into(),
            allow_uids: None,
            allow_gids: None,
            allow_cgroups: None,
            same_cgroup: false,
        };
        let error = Policy::compile(&[bad]).expect_err("bad glob").to_string();
        assert!(error.contains("policy rule #1: name \"[\""), "{error}");
        assert!(toml::from_str::<RuleFile>("allow_uid = [0]").is_err());
    }
}
