//! Rows measured in segments: `e2e --histogram-out FILE` saves a segment's latencies,
//! `merge` adds the segments up into one row. run.sh measures push and poll at a
//! fixed rate in segments that alternate between the two, so a stall of this shared
//! machine falls on both arms alike instead of deciding one arm's p99.

use crate::{histogram, report, Outcome};
use anyhow::{bail, Context};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(clap::Args)]
pub struct MergeArgs {
    /// Label of the merged row.
    #[arg(long, default_value = "courier")]
    pub label: String,
    /// Segment files written by `e2e --histogram-out`, all of one scenario.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

/// Saves a measured segment: its scenario, measured time, errors, and each
/// recorded latency (µs) with its count.
pub fn save(path: &Path, load: &str, o: &Outcome) -> anyhow::Result<()> {
    let mut s = format!(
        "scenario {load}\nelapsed_ms {}\nerrors {}\n",
        o.elapsed.as_millis(),
        o.errors
    );
    for v in o.latency.iter_recorded() {
        let _ = writeln!(s, "{} {}", v.value_iterated_to(), v.count_at_value());
    }
    std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))
}

/// Reads a segment saved by [`save`]: its scenario and outcome.
fn load(path: &Path) -> anyhow::Result<(String, Outcome)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let mut field = |name: &str| -> anyhow::Result<String> {
        let line = lines.next().unwrap_or_default();
        match line.strip_prefix(name).and_then(|r| r.strip_prefix(' ')) {
            Some(v) => Ok(v.to_string()),
            None => bail!("{}: expected '{name} ...', found '{line}'", path.display()),
        }
    };
    let scenario = field("scenario")?;
    let elapsed = Duration::from_millis(field("elapsed_ms")?.parse()?);
    let errors = field("errors")?.parse()?;
    let mut latency = histogram()?;
    for line in lines {
        let (v, n) = line
            .split_once(' ')
            .with_context(|| format!("{}: bad line '{line}'", path.display()))?;
        latency.record_n(v.parse()?, n.parse()?)?;
    }
    Ok((
        scenario,
        Outcome {
            latency,
            errors,
            elapsed,
        },
    ))
}

pub fn run(a: MergeArgs) -> anyhow::Result<()> {
    let mut scenario: Option<String> = None;
    let mut total = Outcome {
        latency: histogram()?,
        errors: 0,
        elapsed: Duration::ZERO,
    };
    for f in &a.files {
        let (s, o) = load(f)?;
        match &scenario {
            Some(first) if *first != s => {
                bail!("{}: scenario '{s}', not '{first}' as before", f.display())
            }
            Some(_) => {}
            None => scenario = Some(s),
        }
        total.latency.add(&o.latency)?;
        total.errors += o.errors;
        total.elapsed += o.elapsed;
    }
    report(&a.label, scenario.as_deref().unwrap_or_default(), &total);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_add_up_to_one_row() {
        let dir = std::env::temp_dir().join(format!("merge-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut parts = Vec::new();
        for (i, values) in [[100u64, 200, 300], [400, 500, 60_000]].iter().enumerate() {
            let mut h = histogram().unwrap();
            for v in values {
                h.record(*v).unwrap();
            }
            let o = Outcome {
                latency: h,
                errors: i as u64,
                elapsed: Duration::from_secs(10),
            };
            let p = dir.join(format!("{i}"));
            save(&p, "push 1000 jobs/s, 8 workers", &o).unwrap();
            parts.push(load(&p).unwrap());
        }
        let mut h = histogram().unwrap();
        for (s, o) in &parts {
            assert_eq!(s, "push 1000 jobs/s, 8 workers");
            h.add(&o.latency).unwrap();
        }
        assert_eq!(h.len(), 6);
        assert_eq!(h.max(), h.highest_equivalent(60_000));
        assert_eq!(h.value_at_quantile(0.5), h.highest_equivalent(300));
        assert_eq!(parts[1].1.errors, 1);
        assert_eq!(parts[1].1.elapsed, Duration::from_secs(10));
        std::fs::write(dir.join("bad"), "scenario x\nelapsed 1\n").unwrap();
        assert!(load(&dir.join("bad")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
