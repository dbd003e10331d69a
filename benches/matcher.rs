//! Measures rule matching: evaluating one request against rule sets of 10 and
//! 1,000 rules (exact values, globs and `*`), for a request matched by the
//! last specific rule and one that falls through to the default rule.

// A benchmark stops at a broken setup.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use tollgate::protocol::parse_line;
use tollgate::rules::RuleSet;

fn rules_ini(count: usize) -> String {
    let mut ini = String::new();
    for i in 0..count - 1 {
        let section = match i % 3 {
            0 => format!("[method=GET path=/api/v{i}/items]"),
            1 => format!("[method=POST path=/api/v{i}/* user=*]"),
            _ => format!("[service=s{i} ip=*]"),
        };
        ini.push_str(&format!(
            "{section}\ncreditLimit=100\nresetSeconds=60\nactorField=ip\n"
        ));
    }
    ini.push_str("[default]\ncreditLimit=10\nresetSeconds=60\n");
    ini
}

fn bench_matcher(c: &mut Criterion) {
    let mut group = c.benchmark_group("evaluate");
    for count in [10usize, 1_000] {
        let rules = RuleSet::from_ini(&rules_ini(count)).unwrap();
        let last = count - 2;
        let hit_last = match last % 3 {
            0 => format!("HIT method=GET path=/api/v{last}/items ip=1.2.3.4"),
            1 => format!("HIT method=POST path=/api/v{last}/x user=u ip=1.2.3.4"),
            _ => format!("HIT service=s{last} ip=1.2.3.4"),
        };
        for (case, line) in [
            ("last-rule", hit_last),
            (
                "default",
                "HIT method=PUT path=/nowhere ip=1.2.3.4".to_string(),
            ),
        ] {
            let command = parse_line(&line).unwrap();
            group.bench_with_input(BenchmarkId::new(case, count), &command, |b, command| {
                b.iter(|| rules.evaluate(black_box(&command.pairs)).count())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_matcher);
criterion_main!(benches);
