//! The run's report: what was injected, what the workload did, what the checker
//! found; as markdown for people and JSON for the docs' figures.

use super::history::Verdict;
use super::{Args, Recovery};
use std::collections::BTreeMap;
use std::time::Duration;

pub struct Report {
    seed: u64,
    duration_s: u64,
    bound: Duration,
    faults: BTreeMap<&'static str, usize>,
    /// Worst recovery per kind of fault, in ms (`None`: past the bound's wait).
    worst: BTreeMap<&'static str, Option<u128>>,
    slow: Vec<String>,
    verdict: Verdict,
}

impl Report {
    pub fn new(seed: u64, args: &Args, recoveries: &[Recovery], verdict: Verdict) -> Report {
        let bound = Duration::from_secs(args.recovery_bound);
        let mut faults = BTreeMap::new();
        let mut worst: BTreeMap<&'static str, Option<u128>> = BTreeMap::new();
        let mut slow = Vec::new();
        for r in recoveries {
            *faults.entry(r.kind).or_insert(0) += 1;
            let ms = r.took.map(|d| d.as_millis());
            let w = worst.entry(r.kind).or_insert(Some(0));
            *w = match (*w, ms) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
            if r.took.is_none_or(|d| d > bound) {
                slow.push(format!(
                    "after `{}` the cluster served again only after {}",
                    r.fault,
                    r.took
                        .map_or("(not within 4x the bound)".into(), |d| format!("{d:.1?}"))
                ));
            }
        }
        Report {
            seed,
            duration_s: args.duration,
            bound,
            faults,
            worst,
            slow,
            verdict,
        }
    }

    /// Violations of every kind: the history's and recoveries past the bound.
    pub fn violations(&self) -> usize {
        self.verdict.violations.len() + self.slow.len()
    }

    fn worst_overall(&self) -> Option<u128> {
        self.worst
            .values()
            .try_fold(0u128, |acc, w| w.map(|w| acc.max(w)))
    }

    pub fn markdown(&self) -> String {
        let v = &self.verdict;
        let mut out = String::new();
        let ms = |w: Option<u128>| w.map_or("unbounded".to_string(), |w| format!("{w} ms"));
        out.push_str(&format!(
            "\n## courier-chaos: seed {}, {} s of faults\n\n",
            self.seed, self.duration_s
        ));
        out.push_str("| fault | injected | worst recovery |\n|---|---:|---:|\n");
        for (kind, n) in &self.faults {
            let w = self.worst.get(kind).copied().flatten();
            out.push_str(&format!("| {kind} | {n} | {} |\n", ms(w)));
        }
        let total: usize = self.faults.values().sum();
        out.push_str(&format!(
            "| **all** | **{total}** | **{}** |\n\n",
            ms(self.worst_overall())
        ));
        out.push_str(&format!(
            "jobs: {} creates acknowledged ({} unknown, {} refused), {} completed \
             ({} by a completion whose answer was lost, {} from creates of unknown \
             outcome); {} activations, {} jobs handed out more than once, {} late \
             deliveries, {} outcomes refused\n\n",
            v.creates_acknowledged,
            v.creates_unknown,
            v.creates_refused,
            v.completed,
            v.completed_unknown_outcome,
            v.completed_unacknowledged_creates,
            v.activations,
            v.jobs_delivered_again,
            v.late_deliveries,
            v.outcomes_refused,
        ));
        out.push_str(&format!(
            "violations: {} (recovery bound {:?})\n",
            self.violations(),
            self.bound
        ));
        for line in v.violations.iter().chain(&self.slow).take(50) {
            out.push_str(&format!("- {line}\n"));
        }
        out
    }

    pub fn json(&self) -> String {
        let v = &self.verdict;
        serde_json::json!({
            "seed": self.seed,
            "duration_s": self.duration_s,
            "recovery_bound_ms": self.bound.as_millis() as u64,
            "faults": self.faults,
            "faults_total": self.faults.values().sum::<usize>(),
            "worst_recovery_ms": self.worst_overall().map(|w| w as u64),
            "worst_recovery_ms_by_fault": self.worst.iter()
                .map(|(k, w)| (k.to_string(), w.map(|w| w as u64)))
                .collect::<BTreeMap<_, _>>(),
            "creates_acknowledged": v.creates_acknowledged,
            "creates_unknown": v.creates_unknown,
            "creates_refused": v.creates_refused,
            "completed": v.completed,
            "completed_unknown_outcome": v.completed_unknown_outcome,
            "completed_unacknowledged_creates": v.completed_unacknowledged_creates,
            "activations": v.activations,
            "jobs_handed_out_again": v.jobs_delivered_again,
            "late_deliveries": v.late_deliveries,
            "outcomes_refused": v.outcomes_refused,
            "violations": self.violations(),
            "violation_list": v.violations.iter().chain(&self.slow).collect::<Vec<_>>(),
        })
        .to_string()
    }
}
