//! What apt is asked to do, decided before it is done: which suite each package comes from, and
//! what `apt-get install -s` says the install would change.
//!
//! Machine images are not always plain Debian: today's ships `qemu-utils` 10.0 from
//! bookworm-backports without that suite in its apt sources, and bookworm's own QEMU 7.2 cannot be
//! installed beside it (`qemu-utils` Breaks `qemu-system-common (< 1:8.0+dfsg-5~)`). So packages
//! that must move together (a [`Family`]) follow the release the machine's installed members came
//! from, and every install is simulated first: a plan that removes or downgrades what the image
//! installed is refused, and a plan apt cannot resolve fails with the package, the conflict and
//! the fix instead of the resolver's dump alone.
//!
//! Everything here is pure (text in, decision out) so it is tested on apt's real output.

use std::fmt;

/// Packages that must come from one Debian release, because they depend on each other's exact
/// versions.
pub struct Family {
    pub name: &'static str,
    /// Package-name prefix of the family's members.
    pub prefix: &'static str,
}

/// QEMU's packages (`qemu-utils`, `qemu-system-*`, `qemu-user`) require each other's exact
/// versions, and newer ones Break older ones.
pub const QEMU: Family = Family {
    name: "QEMU",
    prefix: "qemu-",
};

/// The families xtask installs members of.
pub const FAMILIES: &[Family] = &[QEMU];

/// Where a group of packages is installed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The release's default candidates (`apt-get install` without `-t`).
    Default,
    /// A suite named with `-t`, with the reason it was chosen.
    Suite { suite: String, because: String },
}

impl Origin {
    /// `-t SUITE` for apt-get, if any.
    pub fn target_release_args(&self) -> Vec<String> {
        match self {
            Origin::Default => Vec::new(),
            Origin::Suite { suite, .. } => vec!["-t".into(), suite.clone()],
        }
    }
}

/// An installed package, as `dpkg-query -W -f='${Package} ${Version}\n'` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Installed {
    pub package: String,
    pub version: String,
}

/// Parses `dpkg-query -W -f='${db:Status-Abbrev}|${Package}|${Version}\n'` output, keeping only
/// packages that are installed (status `ii` or `hi`).
pub fn parse_installed(dpkg_query: &str) -> Vec<Installed> {
    dpkg_query
        .lines()
        .filter_map(|line| {
            let mut fields = line.split('|');
            let status = fields.next()?.trim();
            let package = fields.next()?.trim();
            let version = fields.next()?.trim();
            (status.starts_with("ii") || status.starts_with("hi"))
                .then(|| Installed {
                    package: package.into(),
                    version: version.into(),
                })
                .filter(|installed| !installed.version.is_empty())
        })
        .collect()
}

/// The suite a version string says it was built for, when it says so: Debian backports carry
/// `~bpoNN+M` in the version (`1:10.0.2+ds-2+deb13u1~bpo12+1`). The image has no source for that
/// suite, so `apt-cache policy` only shows `/var/lib/dpkg/status`; the version is the evidence.
pub fn backports_suite(version: &str, codename: &str) -> Option<String> {
    version
        .contains("~bpo")
        .then(|| format!("{codename}-backports"))
}

/// Chooses where the missing members of `family` come from so they agree with its installed ones.
pub fn origin_for(family: &Family, installed: &[Installed], codename: &str) -> Origin {
    installed
        .iter()
        .filter(|pkg| pkg.package.starts_with(family.prefix))
        .find_map(|pkg| {
            backports_suite(&pkg.version, codename).map(|suite| Origin::Suite {
                because: format!(
                    "the installed {} {} comes from {suite}, and {} packages must come from one \
                     release",
                    pkg.package, pkg.version, family.name
                ),
                suite,
            })
        })
        .unwrap_or(Origin::Default)
}

/// The family a package belongs to, if any.
pub fn family_of(package: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .find(|family| package.starts_with(family.prefix))
}

/// What `apt-get install -s` would do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Simulation {
    /// `Inst` lines: (package, version to be installed, version installed now if any).
    pub installs: Vec<Change>,
    /// `Remv` lines: packages apt would remove.
    pub removals: Vec<String>,
    /// Unmet dependencies apt reported, if it could not resolve the request.
    pub conflicts: Vec<Conflict>,
}

/// One `Inst` line of a simulation.
#[derive(Debug, PartialEq, Eq)]
pub struct Change {
    pub package: String,
    pub new_version: String,
    pub old_version: Option<String>,
    /// The release apt names for the new version (`Debian Backports:oldstable-backports`).
    pub release: String,
}

/// One unmet dependency from apt's resolver report.
#[derive(Debug, PartialEq, Eq)]
pub struct Conflict {
    /// The package whose relation cannot be met.
    pub package: String,
    /// `Depends`, `Breaks`, `Conflicts`, `PreDepends`...
    pub relation: String,
    /// The other side of the relation, with its version constraint (`qemu-system-common (< 1:8.0)`).
    pub target: String,
    /// apt's reason (`but 1:7.2+dfsg-7 is to be installed`, `but it is not installable`).
    pub reason: String,
}

/// Parses the output of `apt-get install -s ...` (stdout and stderr together).
pub fn parse_simulation(output: &str) -> Simulation {
    let mut simulation = Simulation::default();
    let mut in_unmet = false;
    let mut current_package = String::new();
    for line in output.lines() {
        if let Some(rest) = line.strip_prefix("Inst ") {
            simulation.installs.extend(parse_inst(rest));
            continue;
        }
        if let Some(rest) = line.strip_prefix("Remv ") {
            if let Some(package) = rest.split_whitespace().next() {
                simulation.removals.push(package.into());
            }
            continue;
        }
        if line.starts_with("The following packages have unmet dependencies") {
            in_unmet = true;
            continue;
        }
        if !in_unmet {
            continue;
        }
        if line.starts_with("E:") || line.trim().is_empty() {
            in_unmet = false;
            continue;
        }
        // " pkg : Relation: target (constraint) but reason" or a continuation line
        // "          Relation: target ..." for the same package.
        let relation_part = match line.split_once(" : ") {
            Some((package, rest)) if !package.trim().is_empty() => {
                current_package = package.trim().into();
                rest
            }
            _ => line.trim(),
        };
        if let Some(conflict) = parse_relation(&current_package, relation_part) {
            simulation.conflicts.push(conflict);
        }
    }
    simulation
}

/// `pkg [old] (new release [arch])` or `pkg (new release [arch])`.
fn parse_inst(rest: &str) -> Option<Change> {
    let (package, rest) = rest.split_once(' ')?;
    let (old_version, rest) = match rest.strip_prefix('[') {
        Some(bracketed) => {
            let (old, rest) = bracketed.split_once(']')?;
            (Some(old.to_owned()), rest.trim_start())
        }
        None => (None, rest),
    };
    let inner = rest.strip_prefix('(')?;
    let inner = inner.split_once(')').map_or(inner, |(inner, _)| inner);
    let (new_version, release) = inner.split_once(' ').unwrap_or((inner, ""));
    let release = release
        .rsplit_once(" [")
        .map_or(release, |(release, _)| release);
    Some(Change {
        package: package.into(),
        new_version: new_version.into(),
        old_version,
        release: release.into(),
    })
}

/// `Breaks: qemu-system-common (< 1:8.0+dfsg-5~) but 1:7.2 is to be installed`.
fn parse_relation(package: &str, text: &str) -> Option<Conflict> {
    let (relation, rest) = text.split_once(": ")?;
    if package.is_empty() || relation.contains(' ') {
        return None;
    }
    let (target, reason) = match rest.split_once(" but ") {
        Some((target, reason)) => (target, format!("but {reason}")),
        None => (rest, String::new()),
    };
    Some(Conflict {
        package: package.into(),
        relation: relation.into(),
        target: target.trim().into(),
        reason,
    })
}

/// Why a simulated plan must not be carried out: it takes away what the image installed.
pub fn refusals(simulation: &Simulation, is_downgrade: impl Fn(&str, &str) -> bool) -> Vec<String> {
    let removals = simulation
        .removals
        .iter()
        .map(|package| format!("it would remove {package}"));
    let downgrades = simulation.installs.iter().filter_map(|change| {
        let old = change.old_version.as_deref()?;
        is_downgrade(old, &change.new_version).then(|| {
            format!(
                "it would downgrade {} from {old} to {}",
                change.package, change.new_version
            )
        })
    });
    removals.chain(downgrades).collect()
}

/// An install apt cannot resolve, explained: each conflict, and what to do about it.
pub struct Diagnosis<'a> {
    pub packages: &'a [String],
    pub origin: &'a Origin,
    pub conflicts: &'a [Conflict],
    pub installed: &'a [Installed],
    pub codename: &'a str,
}

impl fmt::Display for Diagnosis<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let from = match self.origin {
            Origin::Default => self.codename.to_owned(),
            Origin::Suite { suite, .. } => suite.clone(),
        };
        writeln!(
            f,
            "apt cannot install {} from {from}:",
            self.packages.join(" ")
        )?;
        for conflict in self.conflicts {
            let installed = self
                .installed
                .iter()
                .find(|pkg| pkg.package == conflict.package);
            let who = match installed {
                Some(pkg) => format!("the installed {} {}", pkg.package, pkg.version),
                None => conflict.package.clone(),
            };
            writeln!(
                f,
                "  - {who} {}: {} {}",
                conflict.relation, conflict.target, conflict.reason
            )?;
            writeln!(f, "    fix: {}", self.fix_for(conflict, installed))?;
        }
        write!(
            f,
            "xtask never removes or downgrades what the image installed; `apt-get install -s {}` \
             shows apt's whole resolution",
            self.packages.join(" ")
        )
    }
}

impl Diagnosis<'_> {
    fn fix_for(&self, conflict: &Conflict, installed: Option<&Installed>) -> String {
        let suite = installed.and_then(|pkg| backports_suite(&pkg.version, self.codename));
        match (suite, self.origin) {
            (Some(suite), Origin::Default) => format!(
                "install from the suite {} came from: add {suite} to apt's sources and run \
                 `apt-get install -t {suite} {}`",
                conflict.package,
                self.packages.join(" ")
            ),
            (_, Origin::Suite { suite, .. }) => format!(
                "{suite} has no version of {} that satisfies this; install a matching {} by hand \
                 (`apt-cache policy {}` lists the versions apt knows), or, if the image does not \
                 need {}, remove it by hand",
                conflict.target_name(),
                conflict.target_name(),
                conflict.target_name(),
                conflict.package
            ),
            (None, Origin::Default) => format!(
                "{} needs a {} that {} does not have: install one that satisfies it by hand \
                 (`apt-cache policy {}` lists the versions apt knows), or, if the image does not \
                 need {}, remove it by hand",
                conflict.package,
                conflict.target,
                self.codename,
                conflict.target_name(),
                conflict.package
            ),
        }
    }
}

impl Conflict {
    /// The package named on the other side of the relation, without its version constraint.
    pub fn target_name(&self) -> &str {
        self.target
            .split_whitespace()
            .next()
            .unwrap_or(&self.target)
    }
}

/// The first URI and `Signed-By` of a deb822 stanza (`*.sources`) that serves `codename` itself.
pub fn mirror_in_deb822(text: &str, codename: &str) -> Option<(String, Option<String>)> {
    text.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza.lines().find_map(|line| {
                line.strip_prefix(name)
                    .and_then(|rest| rest.strip_prefix(':'))
                    .map(str::trim)
            })
        };
        let serves = field("Suites")?
            .split_whitespace()
            .any(|suite| suite == codename);
        let uri = field("URIs")?.split_whitespace().next()?;
        serves.then(|| (uri.to_owned(), field("Signed-By").map(str::to_owned)))
    })
}

/// The URI of a one-line `deb URI codename ...` entry (`sources.list`), options skipped.
pub fn mirror_in_one_line(text: &str, codename: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let mut words = line
            .split_whitespace()
            .filter(|word| !word.starts_with('['));
        if words.next()? != "deb" {
            return None;
        }
        let uri = words.next()?;
        (words.next()? == codename).then(|| uri.to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dpkg-query -W -f='${db:Status-Abbrev}|${Package}|${Version}\n' 'qemu-*'` on today's image.
    const IMAGE_QEMU: &str = "ii |qemu-utils|1:10.0.2+ds-2+deb13u1~bpo12+1\n\
                              un |qemu-system-x86|\n";

    /// `apt-get install -s -y --no-install-recommends qemu-system-x86 busybox-static` on today's
    /// image, without bookworm-backports in apt's sources.
    const UNRESOLVABLE: &str = "Reading package lists...\n\
Building dependency tree...\n\
Reading state information...\n\
Some packages could not be installed. This may mean that you have\n\
requested an impossible situation or if you are using the unstable\n\
distribution that some required packages have not yet been created\n\
or been moved out of Incoming.\n\
The following information may help to resolve the situation:\n\
\n\
The following packages have unmet dependencies:\n \
qemu-utils : Breaks: qemu-system-common (< 1:8.0+dfsg-5~) but 1:7.2+dfsg-7+deb12u18+b3 is to be installed\n\
E: Error, pkgProblemResolver::Resolve generated breaks, this may be caused by held packages.\n";

    /// The same with `qemu-system-x86/bookworm-backports`: several relations of one package.
    const UNRESOLVABLE_SEVERAL: &str = "The following packages have unmet dependencies:\n \
qemu-system-x86 : Depends: qemu-system-common (= 1:10.0.2+ds-2+deb13u1~bpo12+1) but it is not going to be installed\n                   \
Depends: qemu-system-data (> 1:10.0.2+ds~) but 1:7.2+dfsg-7+deb12u18 is to be installed\n                   \
Depends: seabios (> 1.16.3-1~) but 1.16.2-1 is to be installed\n\
E: Unable to correct problems, you have held broken packages.\n";

    /// `apt-get install -s -y --no-install-recommends -t bookworm-backports qemu-system-x86
    /// busybox-static`, with the suite added: it resolves.
    const RESOLVED: &str = "0 upgraded, 23 newly installed, 0 to remove and 158 not upgraded.\n\
Inst busybox-static (1:1.35.0-4+deb12u1+b1 Debian:12.15/oldstable [amd64])\n\
Inst libbrlapi0.8 (6.7-3.1+deb13u3~bpo12+1 Debian Backports:oldstable-backports [amd64])\n\
Inst qemu-system-x86 (1:10.0.2+ds-2+deb13u1~bpo12+1 Debian Backports:oldstable-backports [amd64])\n\
Conf qemu-system-x86 (1:10.0.2+ds-2+deb13u1~bpo12+1 Debian Backports:oldstable-backports [amd64])\n";

    fn numeric_downgrade(old: &str, new: &str) -> bool {
        new < old
    }

    #[test]
    fn qemu_follows_the_backports_release_the_image_installed_qemu_utils_from() {
        let installed = parse_installed(IMAGE_QEMU);
        assert_eq!(installed.len(), 1, "only installed packages count");
        match origin_for(&QEMU, &installed, "bookworm") {
            Origin::Suite { suite, because } => {
                assert_eq!(suite, "bookworm-backports");
                assert!(because.contains("qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1"));
            }
            Origin::Default => panic!("a backports qemu-utils must pull QEMU from backports"),
        }
    }

    #[test]
    fn qemu_comes_from_the_release_itself_when_no_installed_member_is_a_backport() {
        let installed = parse_installed("ii |qemu-utils|1:7.2+dfsg-7+deb12u18+b3\n");
        assert_eq!(origin_for(&QEMU, &installed, "bookworm"), Origin::Default);
        assert_eq!(origin_for(&QEMU, &[], "bookworm"), Origin::Default);
    }

    #[test]
    fn backports_of_other_families_do_not_move_qemu() {
        let installed = parse_installed("ii |linux-image-6.12|6.12.1-1~bpo12+1\n");
        assert_eq!(origin_for(&QEMU, &installed, "bookworm"), Origin::Default);
        assert!(family_of("qemu-user").is_some());
        assert!(family_of("busybox-static").is_none());
    }

    #[test]
    fn an_unresolvable_install_names_the_package_the_conflict_and_the_fix() {
        let simulation = parse_simulation(UNRESOLVABLE);
        assert_eq!(
            simulation.conflicts,
            vec![Conflict {
                package: "qemu-utils".into(),
                relation: "Breaks".into(),
                target: "qemu-system-common (< 1:8.0+dfsg-5~)".into(),
                reason: "but 1:7.2+dfsg-7+deb12u18+b3 is to be installed".into(),
            }]
        );
        let packages = vec!["qemu-system-x86".to_owned(), "busybox-static".to_owned()];
        let installed = parse_installed(IMAGE_QEMU);
        let text = Diagnosis {
            packages: &packages,
            origin: &Origin::Default,
            conflicts: &simulation.conflicts,
            installed: &installed,
            codename: "bookworm",
        }
        .to_string();
        assert!(text.contains("apt cannot install qemu-system-x86 busybox-static from bookworm"));
        assert!(text.contains(
            "the installed qemu-utils 1:10.0.2+ds-2+deb13u1~bpo12+1 Breaks: \
             qemu-system-common (< 1:8.0+dfsg-5~)"
        ));
        assert!(text.contains("apt-get install -t bookworm-backports qemu-system-x86"));
    }

    #[test]
    fn every_relation_of_a_package_is_reported() {
        let simulation = parse_simulation(UNRESOLVABLE_SEVERAL);
        let targets: Vec<&str> = simulation
            .conflicts
            .iter()
            .map(Conflict::target_name)
            .collect();
        assert_eq!(
            targets,
            ["qemu-system-common", "qemu-system-data", "seabios"]
        );
        assert!(
            simulation
                .conflicts
                .iter()
                .all(|c| c.package == "qemu-system-x86" && c.relation == "Depends")
        );
    }

    #[test]
    fn a_resolved_plan_lists_what_it_installs_and_from_where() {
        let simulation = parse_simulation(RESOLVED);
        assert!(simulation.conflicts.is_empty());
        assert!(simulation.removals.is_empty());
        let qemu = simulation
            .installs
            .iter()
            .find(|change| change.package == "qemu-system-x86")
            .expect("qemu-system-x86 is installed");
        assert_eq!(qemu.new_version, "1:10.0.2+ds-2+deb13u1~bpo12+1");
        assert_eq!(qemu.release, "Debian Backports:oldstable-backports");
        assert_eq!(qemu.old_version, None);
        assert!(refusals(&simulation, numeric_downgrade).is_empty());
    }

    #[test]
    fn the_backports_source_uses_the_release_s_own_mirror_and_keyring() {
        // /etc/apt/sources.list.d/debian.sources on today's image.
        let image = "Types: deb\n\
# http://snapshot.debian.org/archive/debian/20250520T000000Z\n\
URIs: http://deb.debian.org/debian\n\
Suites: bookworm bookworm-updates\n\
Components: main\n\
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\
\n\
Types: deb\n\
URIs: http://deb.debian.org/debian-security\n\
Suites: bookworm-security\n\
Components: main\n";
        assert_eq!(
            mirror_in_deb822(image, "bookworm"),
            Some((
                "http://deb.debian.org/debian".into(),
                Some("/usr/share/keyrings/debian-archive-keyring.gpg".into())
            ))
        );
        assert_eq!(mirror_in_deb822(image, "trixie"), None);
        assert_eq!(
            mirror_in_one_line(
                "# comment\ndeb-src http://a/debian bookworm main\n\
                 deb [arch=amd64] http://mirror/debian bookworm main\n",
                "bookworm"
            ),
            Some("http://mirror/debian".into())
        );
    }

    #[test]
    fn a_plan_that_removes_or_downgrades_is_refused() {
        let simulation = parse_simulation(
            "Remv qemu-utils [1:10.0.2+ds-2+deb13u1~bpo12+1]\n\
             Inst seabios [1.16.3-2~bpo12+1] (1.16.2-1 Debian:12.15/oldstable [all])\n\
             Inst libfoo [1.0] (1.1 Debian:12.15/oldstable [amd64])\n",
        );
        assert_eq!(
            refusals(&simulation, numeric_downgrade),
            vec![
                "it would remove qemu-utils".to_owned(),
                "it would downgrade seabios from 1.16.3-2~bpo12+1 to 1.16.2-1".to_owned(),
            ]
        );
    }
}
