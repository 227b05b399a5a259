//! ferrovol's end-to-end tests: the driver installed in a real cluster (by `cargo xtask e2e`),
//! driven through the Kubernetes API with kube-rs.
//!
//! A harness of its own rather than libtest's: libtest can only pass or fail a test, and a case
//! that does not apply to a backend must be reported as skipped, never as passed. Each case runs
//! in a namespace of its own, waits with bounded timeouts, and on failure prints the namespace's
//! events, pods, claims and logs, and the driver's logs.
//!
//! Arguments (libtest-like): `[FILTER…] [--exact] [--skip S]… [--list] [--test-threads N]`.
//! Environment: see [`config::Config::from_env`].

mod cases;
mod config;
mod host;
mod k8s;

use anyhow::{Context, Result, bail};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What became of a case that did not fail.
pub enum Outcome {
    Passed,
    /// The case does not apply to this backend; the reason says why.
    Skipped(String),
}

pub type CaseFuture = Pin<Box<dyn Future<Output = Result<Outcome>> + Send>>;

pub struct Case {
    pub name: &'static str,
    pub run: fn(Arc<config::Ctx>, k8s::Ns) -> CaseFuture,
    /// Runs alone, after every other selected case has finished.
    pub last: bool,
}

/// One case may take this long, waits included.
const CASE_TIMEOUT: Duration = Duration::from_secs(10 * 60);

struct Args {
    filters: Vec<String>,
    skips: Vec<String>,
    exact: bool,
    list: bool,
    threads: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        filters: Vec::new(),
        skips: Vec::new(),
        exact: false,
        list: false,
        threads: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--exact" => args.exact = true,
            "--list" => args.list = true,
            "--skip" => args.skips.push(it.next().context("--skip needs a value")?),
            "--test-threads" => {
                args.threads = it
                    .next()
                    .context("--test-threads needs a value")?
                    .parse()
                    .context("--test-threads takes a number")?;
            }
            // libtest flags cargo or a habit may pass; output is never captured here.
            "--nocapture" | "--show-output" | "-q" | "--quiet" => {}
            flag if flag.starts_with('-') => bail!("unknown option {flag}"),
            _ => args.filters.push(arg),
        }
    }
    args.threads = args.threads.max(1);
    Ok(args)
}

impl Args {
    fn selects(&self, name: &str) -> bool {
        let matches = |f: &String| {
            if self.exact {
                name == f
            } else {
                name.contains(f.as_str())
            }
        };
        (self.filters.is_empty() || self.filters.iter().any(matches))
            && !self.skips.iter().any(|s| name.contains(s.as_str()))
    }
}

enum Verdict {
    Passed,
    Skipped(String),
    Failed(String),
}

fn main() -> std::process::ExitCode {
    match real_main() {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(err) => {
            eprintln!("e2e: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<bool> {
    let args = parse_args()?;
    let selected: Vec<&'static Case> = cases::ALL.iter().filter(|c| args.selects(c.name)).collect();
    if args.list {
        for case in &selected {
            println!("{}: test", case.name);
        }
        return Ok(true);
    }
    // A filter that selects nothing must not look like a green run.
    if selected.is_empty() {
        bail!(
            "no case matches the filter {:?}; the cases are: {}",
            args.filters,
            cases::ALL
                .iter()
                .map(|c| c.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run(selected, args.threads))
}

async fn run(selected: Vec<&'static Case>, threads: usize) -> Result<bool> {
    let ctx = Arc::new(config::Ctx::new().await?);
    println!(
        "e2e: backend {}, driver {}, {} case(s), {} at a time\n",
        ctx.cfg.backend,
        ctx.cfg.driver,
        selected.len(),
        threads
    );
    let started = Instant::now();
    let (first, last): (Vec<_>, Vec<_>) = selected.into_iter().partition(|c| !c.last);
    let permits = Arc::new(tokio::sync::Semaphore::new(threads));
    let mut handles = Vec::new();
    for case in first {
        let (ctx, permits) = (ctx.clone(), permits.clone());
        handles.push(tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            run_case(ctx, case).await
        }));
    }
    let mut results = Vec::new();
    for handle in handles {
        results.push(handle.await.context("a case panicked")?);
    }
    for case in last {
        results.push(run_case(ctx.clone(), case).await);
    }

    println!("\ne2e: results (backend {})", ctx.cfg.backend);
    let (mut passed, mut skipped, mut failed) = (0, 0, 0);
    for (name, took, verdict) in &results {
        let secs = took.as_secs_f64();
        match verdict {
            Verdict::Passed => {
                passed += 1;
                println!("  PASS  {name} ({secs:.1} s)");
            }
            Verdict::Skipped(why) => {
                skipped += 1;
                println!("  SKIP  {name} ({secs:.1} s): {why}");
            }
            Verdict::Failed(why) => {
                failed += 1;
                println!("  FAIL  {name} ({secs:.1} s): {}", first_line(why));
            }
        }
    }
    println!(
        "e2e: {passed} passed, {failed} failed, {skipped} skipped in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(failed == 0)
}

async fn run_case(ctx: Arc<config::Ctx>, case: &'static Case) -> (&'static str, Duration, Verdict) {
    let started = Instant::now();
    println!("[{}] start", case.name);
    let ns = match k8s::Ns::create(&ctx.client, case.name).await {
        Ok(ns) => ns,
        Err(err) => {
            let why = format!("cannot create its namespace: {err:#}");
            println!("[{}] FAILED: {why}", case.name);
            return (case.name, started.elapsed(), Verdict::Failed(why));
        }
    };
    let outcome =
        match tokio::time::timeout(CASE_TIMEOUT, (case.run)(ctx.clone(), ns.clone())).await {
            Ok(outcome) => outcome,
            Err(_) => Err(anyhow::anyhow!(
                "did not finish within {} s",
                CASE_TIMEOUT.as_secs()
            )),
        };
    let verdict = match outcome {
        Ok(Outcome::Passed) => {
            println!("[{}] passed", case.name);
            Verdict::Passed
        }
        Ok(Outcome::Skipped(why)) => {
            println!("[{}] SKIPPED: {why}", case.name);
            Verdict::Skipped(why)
        }
        Err(err) => {
            let why = format!("{err:#}");
            println!("[{}] FAILED: {why}", case.name);
            println!("{}", ns.diagnostics().await);
            println!("{}", k8s::driver_logs(&ctx.client, started.elapsed()).await);
            Verdict::Failed(why)
        }
    };
    // Deleting the namespace deletes the case's claims, and with them its volumes; the cleanup
    // case waits for that and checks that nothing is left on the node or in the backend.
    if let Err(err) = ns.delete().await {
        println!(
            "[{}] warning: cannot delete {}: {err:#}",
            case.name, ns.name
        );
    }
    (case.name, started.elapsed(), verdict)
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}
