//! `cargo xtask e2e [--keep] [--backend local|aws|all] [-- FILTER…]`: the in-cluster tests.
//!
//! Starts the one-node cluster (`cluster::up`), builds the driver's two images exactly as
//! `cargo xtask images` does and imports them, then for each backend: installs the chart with
//! the pinned helm, runs the kube-rs tests of `e2e/` (its own package, built into
//! `target/e2e/`), saves the driver's logs and uninstalls. The aws backend runs against moto,
//! started on the node's IP so that the controller pod can reach it from its network namespace,
//! with the hypervisor stand-in (`ferrovol-hypervisor`) on the host turning moto's attachments
//! into loop devices and by-id links, which the node plugin gets through hostPath volumes and
//! `--by-id-dir`/`--sys-root`. Finally the cluster is stopped, unless `--keep`.
//!
//! Arguments after `--` (or any that are not options) go to the test harness: case-name
//! filters, `--skip NAME`, `--exact`, `--list`.

use crate::render::{self, CHART};
use crate::{cluster, images, tools, util};
use anyhow::{Context, Result, bail, ensure};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RELEASE: &str = "ferrovol";
const NAMESPACE: &str = "kube-system";
/// Secret with moto's dummy credentials for the aws controller (`aws.credentialsSecret`).
const AWS_SECRET: &str = "ferrovol-e2e-aws";
const ZONE: &str = "us-east-1a";
/// Label of everything the tests create (see e2e/tests/e2e/k8s.rs).
const TEST_LABEL: &str = "app.kubernetes.io/part-of=ferrovol-e2e";

const HELM_TIMEOUT: Duration = Duration::from_secs(8 * 60);
const KUBECTL_TIMEOUT: Duration = Duration::from_secs(4 * 60);
const TESTS_TIMEOUT: Duration = Duration::from_secs(40 * 60);
const START_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Local,
    Aws,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Aws => "aws",
        }
    }
}

struct Options {
    keep: bool,
    backends: Vec<Backend>,
    test_args: Vec<String>,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut opts = Options {
        keep: false,
        backends: vec![Backend::Local, Backend::Aws],
        test_args: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--keep" => opts.keep = true,
            "--backend" => {
                opts.backends = match it.next().map(String::as_str) {
                    Some("local") => vec![Backend::Local],
                    Some("aws") => vec![Backend::Aws],
                    Some("all") => vec![Backend::Local, Backend::Aws],
                    other => bail!("--backend takes local, aws or all (got {other:?})"),
                }
            }
            "--" => opts.test_args.extend(it.by_ref().cloned()),
            _ => opts.test_args.push(arg.clone()),
        }
    }
    Ok(opts)
}

/// Progress and timing of each phase, summed up at the end.
#[derive(Default)]
struct Phases {
    done: Vec<(String, Duration, bool)>,
}

impl Phases {
    fn run<T>(&mut self, name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        println!("\n==> e2e: {name}");
        let started = Instant::now();
        let result = f();
        let took = started.elapsed();
        println!(
            "<== e2e: {name}: {} in {:.1} s",
            if result.is_ok() { "done" } else { "FAILED" },
            took.as_secs_f64()
        );
        self.done.push((name.to_string(), took, result.is_ok()));
        result
    }

    fn report(&self, total: Duration) {
        println!("\ne2e: phases");
        for (name, took, ok) in &self.done {
            println!(
                "  {:<48} {:>8.1} s  {}",
                name,
                took.as_secs_f64(),
                if *ok { "ok" } else { "FAILED" }
            );
        }
        println!("  {:<48} {:>8.1} s", "total", total.as_secs_f64());
    }
}

pub fn run(args: &[String]) -> Result<()> {
    let opts = parse(args)?;
    let started = Instant::now();
    let helm = tools::go_tool("helm")?;
    let moto = if opts.backends.contains(&Backend::Aws) {
        Some(tools::moto()?)
    } else {
        None
    };
    let mut phases = Phases::default();
    let outcome = phases
        .run("cluster up", cluster::up)
        .and_then(|()| everything(&mut phases, &opts, &helm, moto.as_deref()));
    if opts.keep {
        println!(
            "\ne2e: --keep: the cluster stays up (KUBECONFIG={}; `cargo xtask cluster down` stops \
             it)",
            cluster::kubeconfig().display()
        );
    } else if let Err(err) = phases.run("cluster down", cluster::down) {
        eprintln!("e2e: warning: {err:#}");
    }
    phases.report(started.elapsed());
    outcome
}

fn everything(phases: &mut Phases, opts: &Options, helm: &Path, moto: Option<&Path>) -> Result<()> {
    phases.run("build and import the driver images", || {
        for archive in images::build_archives()? {
            cluster::import_image(&archive)?;
        }
        Ok(())
    })?;
    phases.run("build the e2e tests", || {
        util::run(tests_command().arg("--no-run"), util::BUILD_TIMEOUT).context("building e2e/")
    })?;
    let mut failed = Vec::new();
    for &backend in &opts.backends {
        if let Err(err) = run_backend(phases, backend, helm, moto, &opts.test_args) {
            eprintln!("e2e: {} backend: {err:#}", backend.name());
            failed.push(format!("{}: {err:#}", backend.name()));
        }
    }
    if !failed.is_empty() {
        bail!(
            "e2e failed:\n  {}\n(logs: {})",
            failed.join("\n  "),
            logs_dir().display()
        );
    }
    Ok(())
}

fn logs_dir() -> PathBuf {
    util::target_dir().join("e2e").join("logs")
}

/// `cargo test` of the e2e package, into target/e2e/ (its own Cargo.lock and dependencies).
fn tests_command() -> Command {
    let mut cmd = util::cargo();
    cmd.args(["test", "--manifest-path", "e2e/Cargo.toml", "--test", "e2e"])
        .arg("--target-dir")
        .arg(util::target_dir().join("e2e"));
    cmd
}

fn run_backend(
    phases: &mut Phases,
    backend: Backend,
    helm: &Path,
    moto: Option<&Path>,
    test_args: &[String],
) -> Result<()> {
    let name = backend.name();
    std::fs::create_dir_all(logs_dir())?;
    let world = match backend {
        Backend::Local => None,
        Backend::Aws => Some(
            phases.run("aws: start moto and the hypervisor stand-in", || {
                AwsWorld::start(moto.context("moto is not installed")?)
            })?,
        ),
    };
    let result = phases
        .run(&format!("{name}: helm install"), || {
            install(helm, backend, world.as_ref())
        })
        .and_then(|()| {
            phases.run(&format!("{name}: tests"), || {
                run_tests(backend, world.as_ref(), test_args)
            })
        });
    save_driver_logs(name);
    let removed = phases.run(&format!("{name}: uninstall"), || uninstall(helm));
    if let Some(world) = world {
        world.stop();
    }
    result.and(removed)
}

fn kubectl() -> Result<Command> {
    let mut cmd = Command::new(cluster::kubectl()?);
    cmd.arg("--kubeconfig").arg(cluster::kubeconfig());
    Ok(cmd)
}

fn helm_cmd(helm: &Path) -> Command {
    let mut cmd = render::helm_command(helm);
    cmd.arg("--kubeconfig").arg(cluster::kubeconfig());
    cmd
}

fn install(helm: &Path, backend: Backend, world: Option<&AwsWorld>) -> Result<()> {
    // A release left by an interrupted or --keep run, maybe of the other backend: start afresh.
    let listed = helm_cmd(helm)
        .args(["list", "--namespace", NAMESPACE, "--short"])
        .output()
        .context("helm list")?;
    if String::from_utf8_lossy(&listed.stdout)
        .lines()
        .any(|l| l.trim() == RELEASE)
    {
        uninstall(helm)?;
    }
    let values = util::target_dir()
        .join("e2e")
        .join(format!("values-{}.yaml", backend.name()));
    std::fs::write(&values, values_yaml(backend, world)?)
        .with_context(|| format!("writing {}", values.display()))?;
    if world.is_some() {
        let secret = util::target_dir().join("e2e").join("aws-secret.yaml");
        std::fs::write(
            &secret,
            format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {AWS_SECRET}\n  namespace: \
                 {NAMESPACE}\nstringData:\n  AWS_ACCESS_KEY_ID: testing\n  \
                 AWS_SECRET_ACCESS_KEY: testing\n"
            ),
        )?;
        util::run(
            kubectl()?.arg("apply").arg("-f").arg(&secret),
            KUBECTL_TIMEOUT,
        )?;
    }
    util::run(
        helm_cmd(helm)
            .args(["install", RELEASE, CHART, "--namespace", NAMESPACE])
            .arg("--values")
            .arg(&values)
            .args(["--wait", "--timeout", "5m"]),
        HELM_TIMEOUT,
    )
    .with_context(|| format!("helm install of the {} backend", backend.name()))
}

/// The chart's values for the test: its defaults, and for aws one controller replica, the
/// emulator's endpoint and credentials and the hypervisor stand-in's identity and directories.
fn values_yaml(backend: Backend, world: Option<&AwsWorld>) -> Result<String> {
    let mut v = format!(
        "# Written by `cargo xtask e2e`.\nbackend: {}\n",
        backend.name()
    );
    if let Some(w) = world {
        let root = w.root.display();
        v.push_str(&format!(
            r#"controller:
  replicas: 1
  extraEnv:
    # No instance metadata here; the SDK must not wait for it.
    - name: AWS_EC2_METADATA_DISABLED
      value: "true"
aws:
  region: us-east-1
  endpointUrl: {endpoint}
  defaultZone: {ZONE}
  credentialsSecret: {AWS_SECRET}
node:
  extraArgs:
    - --node-id={instance}
    - --availability-zone={ZONE}
    - --instance-type=m5.large
    - --by-id-dir={root}/by-id
    - --sys-root={root}/sys
  extraVolumes:
    - name: e2e-hypervisor
      hostPath:
        path: {root}
        type: Directory
  extraVolumeMounts:
    - name: e2e-hypervisor
      mountPath: {root}
      readOnly: true
"#,
            endpoint = w.endpoint,
            instance = w.instance,
        ));
    }
    Ok(v)
}

fn run_tests(backend: Backend, world: Option<&AwsWorld>, test_args: &[String]) -> Result<()> {
    let mut cmd = tests_command();
    cmd.arg("--")
        .args(test_args)
        .env("KUBECONFIG", cluster::kubeconfig())
        .env("FERROVOL_E2E_BACKEND", backend.name())
        .env("FERROVOL_E2E_KUBECTL", cluster::kubectl()?)
        .env("FERROVOL_E2E_KUBELET_DIR", cluster::KUBELET_DIR)
        .env("FERROVOL_E2E_STATE_DIR", "/var/lib/ferrovol");
    if let Some(w) = world {
        cmd.env("FERROVOL_E2E_MOTO", &w.endpoint)
            .env("FERROVOL_E2E_HYPERVISOR_ROOT", &w.root);
    }
    util::run(&mut cmd, TESTS_TIMEOUT).with_context(|| {
        format!(
            "the e2e tests failed on the {} backend (driver logs: {})",
            backend.name(),
            logs_dir()
                .join(format!("{}-driver.log", backend.name()))
                .display()
        )
    })
}

/// Every container log of the driver's pods into target/e2e/logs/<backend>-driver.log.
fn save_driver_logs(backend: &str) {
    let path = logs_dir().join(format!("{backend}-driver.log"));
    let saved = std::fs::File::create(&path)
        .map_err(anyhow::Error::from)
        .and_then(|file| {
            util::run(
                kubectl()?
                    .args(["logs", "--namespace", NAMESPACE])
                    .args(["--selector", "app.kubernetes.io/name=ferrovol"])
                    .args(["--all-containers", "--prefix", "--timestamps"])
                    .args(["--tail=-1", "--max-log-requests=20"])
                    .stdout(file),
                KUBECTL_TIMEOUT,
            )
        });
    match saved {
        Ok(()) => println!("e2e: driver logs in {}", path.display()),
        Err(err) => eprintln!("e2e: warning: cannot save the driver's logs: {err:#}"),
    }
}

/// Deletes what the tests left (so that the driver, still installed, deletes their volumes),
/// then the release.
fn uninstall(helm: &Path) -> Result<()> {
    let leftovers = util::run(
        kubectl()?
            .args([
                "delete",
                "namespaces,storageclasses",
                "--selector",
                TEST_LABEL,
            ])
            .args(["--ignore-not-found", "--wait", "--timeout=180s"]),
        KUBECTL_TIMEOUT,
    );
    if let Err(err) = &leftovers {
        eprintln!("e2e: warning: cannot delete the tests' leftovers: {err:#}");
    }
    util::run(
        helm_cmd(helm)
            .args(["uninstall", RELEASE, "--namespace", NAMESPACE])
            .args(["--wait", "--timeout", "3m"]),
        HELM_TIMEOUT,
    )?;
    util::run(
        kubectl()?
            .args(["delete", "secret", AWS_SECRET, "--namespace", NAMESPACE])
            .arg("--ignore-not-found"),
        KUBECTL_TIMEOUT,
    )
}

/// moto and the hypervisor stand-in, on the host.
struct AwsWorld {
    moto: Child,
    hypervisor: Child,
    endpoint: String,
    instance: String,
    /// The hypervisor's root: by-id/, sys/, disks/, snapshots/.
    root: PathBuf,
}

impl AwsWorld {
    fn start(moto_server: &Path) -> Result<AwsWorld> {
        let bin = util::target_dir()
            .join(util::PROFILE)
            .join("ferrovol-hypervisor");
        ensure!(
            bin.is_file(),
            "{} is missing (the image build compiles every binary of the workspace)",
            bin.display()
        );
        // The controller pod reaches moto from its own network namespace: through the node's
        // address, not loopback.
        let ip = node_ip()?;
        let port = std::net::TcpListener::bind((ip.as_str(), 0))
            .with_context(|| format!("binding a port on {ip}"))?
            .local_addr()?
            .port();
        let endpoint = format!("http://{ip}:{port}");
        let root = util::target_dir().join("e2e").join("hypervisor");
        let mut moto = spawn_logged(
            Command::new(moto_server).args(["-H", &ip, "-p", &port.to_string()]),
            &logs_dir().join("moto.log"),
        )?;
        let deadline = Instant::now() + START_TIMEOUT;
        let started = wait_listening(&ip, port, deadline, &mut moto)
            .and_then(|()| util::fresh_dir(&root))
            .and_then(|()| {
                let log = logs_dir().join("hypervisor.log");
                let mut hypervisor = spawn_logged(
                    Command::new(&bin)
                        .args(["--endpoint", &endpoint, "--zone", ZONE, "--root"])
                        .arg(&root),
                    &log,
                )?;
                match wait_instance(&log, deadline, &mut hypervisor) {
                    Ok(instance) => Ok((hypervisor, instance)),
                    Err(err) => {
                        stop_child("hypervisor", &mut hypervisor);
                        util::cleanup_loop_devices(&root);
                        Err(err)
                    }
                }
            });
        let (hypervisor, instance) = match started {
            Ok(started) => started,
            Err(err) => {
                stop_child("moto", &mut moto);
                return Err(err);
            }
        };
        println!(
            "e2e: moto at {endpoint}, instance {instance} (hypervisor root {})",
            root.display()
        );
        Ok(AwsWorld {
            moto,
            hypervisor,
            endpoint,
            instance,
            root,
        })
    }

    /// Stops the hypervisor (SIGTERM: it detaches its loop devices), then moto; detaches any loop
    /// device still backed by one of its disks.
    fn stop(mut self) {
        stop_child("hypervisor", &mut self.hypervisor);
        stop_child("moto", &mut self.moto);
        util::cleanup_loop_devices(&self.root);
    }
}

fn wait_listening(ip: &str, port: u16, deadline: Instant, child: &mut Child) -> Result<()> {
    while std::net::TcpStream::connect((ip, port)).is_err() {
        if let Some(status) = child.try_wait()? {
            bail!(
                "moto exited ({status}); see {}",
                logs_dir().join("moto.log").display()
            );
        }
        ensure!(
            Instant::now() < deadline,
            "moto did not listen on {ip}:{port} within {} s",
            START_TIMEOUT.as_secs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// The hypervisor prints `instance=<id>` once its instance runs and its directories exist.
fn wait_instance(log: &Path, deadline: Instant, child: &mut Child) -> Result<String> {
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(id) = text.lines().find_map(|l| l.strip_prefix("instance=")) {
            return Ok(id.trim().to_string());
        }
        if Instant::now() >= deadline || child.try_wait()?.is_some() {
            bail!(
                "the hypervisor stand-in did not start:\n{}",
                util::tail(log, 20)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn stop_child(name: &str, child: &mut Child) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    let _ = util::signal(&[child.id().to_string()], "TERM");
    if !matches!(
        util::wait_timeout(child, Duration::from_secs(10)),
        Ok(Some(_))
    ) {
        eprintln!("e2e: warning: {name} did not stop within 10 s of SIGTERM and was killed");
    }
}

/// The node's InternalIP, where pods reach the host.
fn node_ip() -> Result<String> {
    let out = kubectl()?
        .args(["get", "node", cluster::NODE_NAME, "--output"])
        .arg(r#"jsonpath={.status.addresses[?(@.type=="InternalIP")].address}"#)
        .output()
        .context("kubectl get node")?;
    ensure!(
        out.status.success(),
        "kubectl get node {} failed: {}",
        cluster::NODE_NAME,
        String::from_utf8_lossy(&out.stderr)
    );
    let ip = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ensure!(
        ip.parse::<std::net::Ipv4Addr>()
            .is_ok_and(|a| !a.is_loopback()),
        "node {} has no usable InternalIP (got {ip:?})",
        cluster::NODE_NAME
    );
    Ok(ip)
}

fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let file =
        std::fs::File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    cmd.stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .env("NO_COLOR", "1");
    println!("$ {} > {}", util::display(cmd), log.display());
    cmd.spawn()
        .with_context(|| format!("cannot start {}", util::display(cmd)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options() {
        let args = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
        let o = parse(&args("--keep --backend aws -- snapshot --exact")).expect("parse");
        assert!(o.keep);
        assert!(o.backends == [Backend::Aws]);
        assert_eq!(o.test_args, ["snapshot", "--exact"]);
        let o = parse(&args("raw_block")).expect("parse");
        assert!(!o.keep);
        assert!(o.backends == [Backend::Local, Backend::Aws]);
        assert_eq!(o.test_args, ["raw_block"]);
        assert!(parse(&args("--backend gcp")).is_err());
    }
}
