//! The `tollgate-loadtest` binary: parse the flags, run the load (the library does the work), print
//! the table, write the `--json` and `--plot` files, and turn a `--check` violation into exit status 3;
//! or run the `failover-probe` measurement and print its line.

use std::process::ExitCode;

use clap::Parser;
use tollgate_loadtest::{failover, plot, run_with_progress, Args, Mode};

fn main() -> ExitCode {
    let args = Args::parse();
    match real_main(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tollgate-loadtest: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn real_main(args: &Args) -> anyhow::Result<ExitCode> {
    if let Some(Mode::FailoverProbe(probe)) = &args.mode {
        println!("{}", failover::probe(probe)?);
        return Ok(ExitCode::SUCCESS);
    }
    let report = run_with_progress(args, !args.quiet)?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        report.write_json(path)?;
    }
    if let Some(path) = &args.plot {
        let load = match args.rate {
            Some(r) => format!("open loop {r}/s"),
            None => "closed loop".to_string(),
        };
        let title = format!(
            "{} {}: {load}, {} connections x pipeline {}",
            report.protocol_name(),
            report.target_addr,
            args.connections,
            args.pipeline
        );
        plot::write_svg(path, &report.histogram, &title)?;
    }
    Ok(if report.check_failed() {
        ExitCode::from(3)
    } else {
        ExitCode::SUCCESS
    })
}
