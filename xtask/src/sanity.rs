//! `cargo xtask sanity [--keep]`: runs the upstream CSI conformance suite, csi-sanity, against
//! csi-controller and csi-node of the local backend, once per access type (mount, block).
//!
//! The driver mounts file systems and attaches loop devices, so the suite runs in a private mount
//! namespace: this task re-executes itself as `unshare --mount --propagation private xtask
//! sanity-inner <workdir>`, and no mount can outlive the run or leak to the host. Loop devices
//! are not namespaced, so afterwards the outer process detaches every one backed by a file of
//! the work directory, whatever happened inside.
//!
//! Work directory: target/sanity/<pid>/<mode>/ holds the plugins' logs, csi-sanity's output and
//! its JUnit report. It is removed after a successful run unless `--keep` is given.

use crate::{tools, util};
use anyhow::{Context, Result, anyhow, bail, ensure};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Every run: the backend and the access type csi-sanity tests volumes with.
const RUNS: [(&str, &str); 4] = [
    ("local", "mount"),
    ("local", "block"),
    ("aws", "mount"),
    ("aws", "block"),
];
const NODE_ID: &str = "sanity-node";
const VOLUME_SIZE: &str = "67108864"; // 64 MiB
const EXPANDED_VOLUME_SIZE: &str = "134217728"; // 128 MiB
// EBS sizes are whole GiB (sparse files behind the hypervisor stand-in, so cheap).
const AWS_VOLUME_SIZE: &str = "1073741824";
const AWS_EXPANDED_VOLUME_SIZE: &str = "2147483648";

const INNER_TIMEOUT: Duration = Duration::from_secs(20 * 60);
const SANITY_TIMEOUT: Duration = Duration::from_secs(10 * 60);
const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The outer half: tools, build, the namespaced run, cleanup, and the report.
pub fn run(keep: bool) -> Result<()> {
    tools::debian_packages()?;
    tools::csi_sanity()?;
    let moto = tools::moto()?;
    util::run(
        util::cargo().args(["build", "--profile", util::PROFILE, "--workspace", "--bins"]),
        util::BUILD_TIMEOUT,
    )
    .context("building the driver binaries")?;

    let workdir = util::target_dir()
        .join("sanity")
        .join(std::process::id().to_string());
    util::fresh_dir(&workdir)?;
    // Not current_exe(): building the workspace unifies dependency features differently from
    // building xtask alone, so the build above may have replaced target/debug/xtask with a new
    // file. /proc/<pid>/exe still executes the running binary, even once its file is unlinked.
    let exe = format!("/proc/{}/exe", std::process::id());
    let mut inner = util::unshare(&exe);
    inner
        .arg("sanity-inner")
        .arg(&workdir)
        .env("FERROVOL_MOTO", &moto)
        .env("PATH", util::path_with_sbin());
    let inner_result = util::run(&mut inner, INNER_TIMEOUT);
    // The trap: runs whatever happened inside, before anything can return early.
    util::cleanup(&workdir);

    let mut problems = Vec::new();
    let mut reports = Vec::new();
    for (backend, mode) in RUNS {
        let name = run_name(backend, mode);
        let junit = workdir.join(name).join("junit.xml");
        match std::fs::read_to_string(&junit) {
            Ok(xml) => reports.push((name, Report::parse(&xml))),
            Err(_) => problems.push(format!(
                "{name}: csi-sanity produced no JUnit report (see {})",
                workdir.join(name).join("sanity.log").display()
            )),
        }
    }
    print_reports(&reports);
    for (mode, report) in &reports {
        if report.failed.len() + report.passed == 0 {
            problems.push(format!("{mode}: the JUnit report holds no spec"));
        }
        for (name, message) in &report.failed {
            problems.push(format!("{mode}: FAILED {name}: {}", first_line(message)));
        }
    }

    // The reports explain a failed inner run, if they can.
    if let (Err(err), true) = (&inner_result, problems.is_empty()) {
        problems.push(format!("{err:#}"));
    }
    if problems.is_empty() && !keep {
        util::remove_dir(&workdir)?;
    } else {
        println!(
            "\nsanity: logs and JUnit reports are in {}",
            workdir.display()
        );
        for (backend, mode) in RUNS {
            println!(
                "  {}/{{controller,node,sanity}}.log",
                workdir.join(run_name(backend, mode)).display()
            );
        }
    }
    let total = |count: fn(&Report) -> usize| reports.iter().map(|(_, r)| count(r)).sum::<usize>();
    println!(
        "sanity: {} passed, {} failed, {} skipped",
        total(|r| r.passed),
        total(|r| r.failed.len()),
        // Ginkgo reports disabled specs as skipped too.
        total(|r| r.skipped.len() + r.pending.len()),
    );
    if !problems.is_empty() {
        bail!("csi-sanity failed:\n  {}", problems.join("\n  "));
    }
    Ok(())
}

/// The inner half, `xtask sanity-inner <workdir>`, run by [`run`] in a private mount namespace.
pub fn run_inner(args: &[String]) -> Result<()> {
    let [workdir] = args else {
        bail!("usage: xtask sanity-inner <absolute work directory>")
    };
    let workdir = PathBuf::from(workdir);
    ensure!(
        workdir.is_absolute(),
        "sanity-inner: {} is not absolute",
        workdir.display()
    );
    ensure!(
        util::in_private_mount_namespace(),
        "sanity-inner must run in a private mount namespace: use `cargo xtask sanity`"
    );
    let csi_sanity = tools::csi_sanity()?;
    let bin_dir = util::target_dir().join(util::PROFILE);

    let mut failed = Vec::new();
    for (backend, mode) in RUNS {
        let name = run_name(backend, mode);
        println!("\nsanity: {backend} backend, access type {mode}");
        if let Err(err) = run_mode(&csi_sanity, &bin_dir, &workdir.join(name), backend, mode) {
            eprintln!("sanity: {name}: {err:#}");
            failed.push(name);
        }
    }
    if !failed.is_empty() {
        bail!("sanity-inner: run(s) {} failed", failed.join(", "));
    }
    Ok(())
}

fn run_name(backend: &str, mode: &str) -> &'static str {
    match (backend, mode) {
        ("local", "mount") => "local-mount",
        ("local", "block") => "local-block",
        ("aws", "mount") => "aws-mount",
        _ => "aws-block",
    }
}

/// The aws backend's world for one run: moto on loopback and the hypervisor stand-in
/// (`ferrovol-hypervisor`), which starts an instance and presents its attachments as loop
/// devices with by-id links and serials.
struct AwsWorld {
    moto: Plugin,
    hypervisor: Plugin,
    endpoint: String,
    instance: String,
    by_id: PathBuf,
    sys: PathBuf,
}

impl AwsWorld {
    fn start(bin_dir: &Path, dir: &Path) -> Result<AwsWorld> {
        let moto_server = std::env::var_os("FERROVOL_MOTO")
            .context("FERROVOL_MOTO is not set (cargo xtask sanity sets it)")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let moto = Plugin::start(
            Command::new(moto_server).args(["-H", "127.0.0.1", "-p", &port.to_string()]),
            &dir.join("moto.log"),
        )?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            ensure!(
                std::time::Instant::now() < deadline,
                "moto did not listen on port {port} within 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let endpoint = format!("http://127.0.0.1:{port}");
        // It prints instance=…, by-id=… and sys=… lines to its log once ready.
        let out = dir.join("hypervisor.log");
        let hypervisor = Plugin::start(
            Command::new(bin_dir.join("ferrovol-hypervisor"))
                .args(["--endpoint", &endpoint, "--root"])
                .arg(dir.join("hypervisor")),
            &out,
        )?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let field = |k: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(k))
                    .map(str::to_string)
            };
            if let (Some(instance), Some(by_id), Some(sys)) =
                (field("instance="), field("by-id="), field("sys="))
            {
                return Ok(AwsWorld {
                    moto,
                    hypervisor,
                    endpoint,
                    instance,
                    by_id: by_id.into(),
                    sys: sys.into(),
                });
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "the hypervisor stand-in did not start (see {})",
                dir.join("hypervisor.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn stop(mut self) -> Result<()> {
        let a = self.hypervisor.stop();
        let b = self.moto.stop();
        a.and(b)
    }
}

const AWS_ENV: [(&str, &str); 4] = [
    ("AWS_ACCESS_KEY_ID", "testing"),
    ("AWS_SECRET_ACCESS_KEY", "testing"),
    ("AWS_REGION", "us-east-1"),
    ("AWS_EC2_METADATA_DISABLED", "true"),
];

fn run_mode(
    csi_sanity: &Path,
    bin_dir: &Path,
    dir: &Path,
    backend: &str,
    mode: &str,
) -> Result<()> {
    let kubelet = dir.join("kubelet");
    let state = dir.join("state");
    for d in [&kubelet, &state] {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    let controller_sock = dir.join("controller.sock");
    let node_sock = dir.join("node.sock");
    for sock in [&controller_sock, &node_sock] {
        // sockaddr_un holds 107 bytes of path and a NUL.
        ensure!(
            sock.as_os_str().len() <= 107,
            "{} is too long for a unix socket: move the clone to a shorter path",
            sock.display()
        );
    }

    let world = if backend == "aws" {
        Some(AwsWorld::start(bin_dir, dir)?)
    } else {
        None
    };
    let mut controller_cmd = Command::new(bin_dir.join("csi-controller"));
    controller_cmd
        .arg("--endpoint")
        .arg(endpoint(&controller_sock))
        .arg("--state-dir")
        .arg(&state);
    let mut node_cmd = Command::new(bin_dir.join("csi-node"));
    node_cmd
        .arg("--endpoint")
        .arg(endpoint(&node_sock))
        .arg("--state-dir")
        .arg(&state)
        .arg("--kubelet-dir")
        .arg(&kubelet);
    match &world {
        None => {
            controller_cmd.args(["--node-id", NODE_ID]);
            node_cmd.args(["--node-id", NODE_ID]);
        }
        Some(w) => {
            controller_cmd
                .args([
                    "--backend",
                    "aws",
                    "--aws-endpoint-url",
                    &w.endpoint,
                    "--default-zone",
                    "us-east-1a",
                    "--poll-initial-ms",
                    "20",
                ])
                .envs(AWS_ENV);
            node_cmd
                .args([
                    "--backend",
                    "aws",
                    "--node-id",
                    &w.instance,
                    "--availability-zone",
                    "us-east-1a",
                    "--instance-type",
                    "m5.large",
                ])
                .arg("--by-id-dir")
                .arg(&w.by_id)
                .arg("--sys-root")
                .arg(&w.sys)
                .args(["--device-wait-seconds", "10"])
                .envs(AWS_ENV);
        }
    }
    let mut controller = Plugin::start(&mut controller_cmd, &dir.join("controller.log"))?;
    let mut node = Plugin::start(&mut node_cmd, &dir.join("node.log"))?;
    controller.wait_for_socket(&controller_sock)?;
    node.wait_for_socket(&node_sock)?;

    let log_path = dir.join("sanity.log");
    let log =
        File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let mut cmd = Command::new(csi_sanity);
    cmd.arg("--csi.endpoint")
        .arg(endpoint(&node_sock))
        .arg("--csi.controllerendpoint")
        .arg(endpoint(&controller_sock))
        .arg("--csi.mountdir")
        .arg(kubelet.join("mnt"))
        .arg("--csi.stagingdir")
        .arg(kubelet.join("staging"))
        .args([
            "--csi.testvolumesize",
            if world.is_some() {
                AWS_VOLUME_SIZE
            } else {
                VOLUME_SIZE
            },
        ])
        .args([
            "--csi.testvolumeexpandsize",
            if world.is_some() {
                AWS_EXPANDED_VOLUME_SIZE
            } else {
                EXPANDED_VOLUME_SIZE
            },
        ])
        .args(["--csi.testvolumeaccesstype", mode])
        .args(mutable_parameters(dir, world.is_some())?)
        .arg("--ginkgo.junit-report")
        .arg(dir.join("junit.xml"))
        .arg("--ginkgo.no-color")
        .stdout(log.try_clone()?)
        .stderr(log);
    let result = util::run(&mut cmd, SANITY_TIMEOUT)
        .map_err(|err| anyhow!("{err:#}; its output is in {}", log_path.display()));
    println!(
        "{}",
        summary(&std::fs::read_to_string(&log_path).unwrap_or_default())
    );

    let stopped = [
        controller.stop(),
        node.stop(),
        world.map_or(Ok(()), AwsWorld::stop),
    ];
    result?;
    stopped.into_iter().collect()
}

/// For the aws runs, a VolumeAttributesClass to exercise ControllerModifyVolume for real.
fn mutable_parameters(dir: &Path, aws: bool) -> Result<Vec<String>> {
    if !aws {
        return Ok(vec![]);
    }
    let file = dir.join("mutable-parameters.yaml");
    std::fs::write(&file, "throughput: \"200\"\niops: \"3000\"\n")?;
    Ok(vec![
        "--csi.testvolumemutableparameters".into(),
        file.display().to_string(),
    ])
}

fn endpoint(socket: &Path) -> String {
    format!("unix://{}", socket.display())
}

/// Ginkgo's closing lines: the failure summary if any, then "Ran N of M Specs" to the end.
fn summary(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    let start = lines
        .iter()
        .rposition(|l| l.starts_with("Summarizing "))
        .or_else(|| lines.iter().rposition(|l| l.starts_with("Ran ")))
        .unwrap_or(lines.len().saturating_sub(5));
    let end = lines.len().min(start + 60);
    lines[start..end]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A plugin process with its output in a log file; stopped (SIGTERM, then SIGKILL) on drop.
struct Plugin {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Plugin {
    fn start(cmd: &mut Command, log: &Path) -> Result<Plugin> {
        let name = Path::new(cmd.get_program())
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let file = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
        // Plain logs in the files (tracing-subscriber honours NO_COLOR).
        cmd.stdout(file.try_clone()?)
            .stderr(file)
            .env("NO_COLOR", "1");
        println!("$ {} > {}", util::display(cmd), log.display());
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        Ok(Plugin {
            name,
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    fn wait_for_socket(&mut self, socket: &Path) -> Result<()> {
        let deadline = Instant::now() + SOCKET_TIMEOUT;
        while !socket.exists() {
            if let Some(child) = &mut self.child
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "{} exited ({status}) before listening:\n{}",
                    self.name,
                    util::tail(&self.log, 20)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not create {} within {} s:\n{}",
                    self.name,
                    socket.display(),
                    SOCKET_TIMEOUT.as_secs(),
                    util::tail(&self.log, 20)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Fails if the plugin had exited on its own before being told to stop.
    fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if let Some(status) = child.try_wait()? {
            bail!(
                "{} died during the run ({status}):\n{}",
                self.name,
                util::tail(&self.log, 20)
            );
        }
        let _ = util::signal(&[child.id().to_string()], "TERM");
        if util::wait_timeout(&mut child, STOP_TIMEOUT)?.is_none() {
            eprintln!(
                "warning: {} did not exit within {} s of SIGTERM and was killed",
                self.name,
                STOP_TIMEOUT.as_secs()
            );
        }
        Ok(())
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            eprintln!("warning: {err:#}");
        }
    }
}

/// The outcome of one csi-sanity run, read from Ginkgo's JUnit report.
#[derive(Debug, Default)]
struct Report {
    passed: usize,
    /// (spec, failure message)
    failed: Vec<(String, String)>,
    /// (spec, skip message)
    skipped: Vec<(String, String)>,
    /// specs disabled in the suite's source (`XIt`/`PIt`)
    pending: Vec<String>,
}

impl Report {
    /// Scans `<testcase>` elements; a spec's `status` attribute says what became of it, and its
    /// `<skipped>`, `<failure>` or `<error>` child says why. Suite-level nodes (`[BeforeSuite]`
    /// and the like) count only when they fail, as in Ginkgo's own summary.
    fn parse(xml: &str) -> Report {
        let mut report = Report::default();
        let mut rest = xml;
        while let Some(start) = rest.find("<testcase") {
            rest = &rest[start + "<testcase".len()..];
            if !rest.starts_with(|c: char| c.is_whitespace() || c == '>' || c == '/') {
                continue;
            }
            let Some(tag_end) = rest.find('>') else { break };
            let tag = &rest[..tag_end];
            let body = if tag.ends_with('/') {
                ""
            } else {
                let body = &rest[tag_end + 1..];
                &body[..body.find("</testcase>").unwrap_or(body.len())]
            };
            rest = &rest[tag_end + 1 + body.len()..];

            let full_name = attr(tag, "name").unwrap_or_default();
            let is_spec = full_name.starts_with("[It]");
            let name = full_name
                .strip_prefix("[It] ")
                .unwrap_or(&full_name)
                .to_string();
            let skip_message = child_attr(body, "skipped", "message");
            let failure_message = child_attr(body, "failure", "message")
                .or_else(|| child_attr(body, "error", "message"));
            let status = attr(tag, "status").unwrap_or_else(|| {
                // Reports without a status attribute: infer it from the children.
                match (&failure_message, &skip_message) {
                    (Some(_), _) => "failed".into(),
                    (None, Some(m)) if m == "pending" => "pending".into(),
                    (None, Some(_)) => "skipped".into(),
                    (None, None) => "passed".into(),
                }
            });
            match status.as_str() {
                "passed" if is_spec => report.passed += 1,
                "passed" => {}
                "pending" => report.pending.push(name),
                "skipped" => {
                    let message = skip_message.unwrap_or_default();
                    let message = message.strip_prefix("skipped - ").unwrap_or(&message);
                    report.skipped.push((name, message.to_string()));
                }
                other => report.failed.push((
                    full_name,
                    failure_message.unwrap_or_else(|| format!("status {other}")),
                )),
            }
        }
        report
    }
}

fn print_reports(reports: &[(&str, Report)]) {
    if reports.is_empty() {
        return;
    }
    println!(
        "\n{:<6} | {:>6} | {:>6} | {:>7} | {:>7}",
        "mode", "passed", "failed", "skipped", "pending"
    );
    println!(
        "{:-<6}-+-{:->6}-+-{:->6}-+-{:->7}-+-{:->7}",
        "", "", "", "", ""
    );
    for (mode, r) in reports {
        println!(
            "{:<6} | {:>6} | {:>6} | {:>7} | {:>7}",
            mode,
            r.passed,
            r.failed.len(),
            r.skipped.len(),
            r.pending.len()
        );
    }

    // Skipped and pending specs grouped by message, each spec once with the modes it was
    // skipped in.
    // (message, [(spec, modes)])
    type Group<'a> = (String, Vec<(String, Vec<&'a str>)>);
    let mut groups: Vec<Group> = Vec::new();
    for (mode, r) in reports {
        let pending = r
            .pending
            .iter()
            .map(|name| (name, "pending: disabled in the suite (XIt)".to_string()));
        let skipped = r
            .skipped
            .iter()
            .map(|(name, message)| (name, one_line(message)));
        for (name, message) in skipped.chain(pending) {
            let index = match groups.iter().position(|(m, _)| *m == message) {
                Some(index) => index,
                None => {
                    groups.push((message, Vec::new()));
                    groups.len() - 1
                }
            };
            let specs = &mut groups[index].1;
            match specs.iter_mut().find(|(n, _)| n == name) {
                Some((_, modes)) => modes.push(mode),
                None => specs.push((name.clone(), vec![mode])),
            }
        }
    }
    if !groups.is_empty() {
        println!("\nskipped specs, by reason:");
        for (message, specs) in groups {
            println!("  {message}");
            for (name, modes) in specs {
                println!("    [{}] {name}", modes.join(", "));
            }
        }
    }
    for (mode, r) in reports {
        for (name, message) in &r.failed {
            println!("\n{mode}: FAILED {name}\n{}", indent(message));
        }
    }
    println!();
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn first_line(s: &str) -> &str {
    s.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The value of attribute `name` in the inside of a start tag, unescaped.
fn attr(tag: &str, name: &str) -> Option<String> {
    let needle = format!("{name}=\"");
    let mut from = 0;
    while let Some(pos) = tag[from..].find(&needle) {
        let at = from + pos;
        // Whole attribute names only: `name=` must not match inside `classname=`.
        if at > 0 && tag[..at].ends_with(char::is_whitespace) {
            let value = &tag[at + needle.len()..];
            return Some(unescape(&value[..value.find('"')?]));
        }
        from = at + needle.len();
    }
    None
}

/// Attribute `name` of the first `<element>` in `body`.
fn child_attr(body: &str, element: &str, name: &str) -> Option<String> {
    let open = format!("<{element}");
    let start = body.find(&open)? + open.len();
    let tag = &body[start..];
    attr(&tag[..tag.find('>')?], name)
}

/// Replaces XML's character references: the five named entities and numeric `&#NN;`/`&#xHH;`.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let decoded = rest.find(';').filter(|&semi| semi <= 10).and_then(|semi| {
            let c = match &rest[1..semi] {
                "quot" => '"',
                "amp" => '&',
                "lt" => '<',
                "gt" => '>',
                "apos" => '\'',
                entity => {
                    let code = if let Some(hex) = entity
                        .strip_prefix("#x")
                        .or_else(|| entity.strip_prefix("#X"))
                    {
                        u32::from_str_radix(hex, 16).ok()
                    } else {
                        entity.strip_prefix('#').and_then(|dec| dec.parse().ok())
                    };
                    char::from_u32(code?)?
                }
            };
            Some((c, semi))
        });
        match decoded {
            Some((c, semi)) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const JUNIT: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
  <testsuites tests="5" disabled="2" errors="0" failures="1" time="1.5">
      <testsuite name="CSI Driver Test Suite" package="/x" tests="5" disabled="1" skipped="1" errors="0" failures="1" time="1.5" timestamp="2026-01-01T00:00:00">
          <properties>
              <property name="SuiteSucceeded" value="false"></property>
          </properties>
          <testcase name="[BeforeSuite]" classname="CSI Driver Test Suite" status="passed" time="0"></testcase>
          <testcase name="[It] Node Service should work" classname="CSI Driver Test Suite" status="passed" time="0.1">
              <system-err>&gt; Enter [It] should work</system-err>
          </testcase>
          <testcase name="[It] Controller Service [Controller Server] ListSnapshots should return snapshots" classname="CSI Driver Test Suite" status="skipped" time="0">
              <skipped message="skipped - Snapshot &#39;list&#39; &quot;not&quot; supported &amp; &lt;ok&gt;"></skipped>
          </testcase>
          <testcase name="[It] Node Service should be idempotent" classname="CSI Driver Test Suite" status="pending" time="0">
              <skipped message="pending"></skipped>
          </testcase>
          <testcase name="[It] Controller Service should fail" classname="CSI Driver Test Suite" status="failed" time="0.2">
              <failure message="Expected&#xA;    &lt;bool&gt;: false" type="failed">stack</failure>
          </testcase>
      </testsuite>
  </testsuites>"#;

    #[test]
    fn parses_ginkgo_junit() {
        let r = Report::parse(JUNIT);
        assert_eq!(r.passed, 1);
        assert_eq!(r.pending, ["Node Service should be idempotent"]);
        assert_eq!(r.skipped.len(), 1);
        assert_eq!(
            r.skipped[0],
            (
                "Controller Service [Controller Server] ListSnapshots should return snapshots"
                    .into(),
                r#"Snapshot 'list' "not" supported & <ok>"#.into()
            )
        );
        assert_eq!(r.failed.len(), 1);
        assert_eq!(r.failed[0].0, "[It] Controller Service should fail");
        assert_eq!(r.failed[0].1, "Expected\n    <bool>: false");
    }

    #[test]
    fn attributes() {
        let tag = r#" name="a" classname="b" status="passed""#;
        assert_eq!(attr(tag, "name").as_deref(), Some("a"));
        assert_eq!(attr(tag, "classname").as_deref(), Some("b"));
        assert_eq!(attr(tag, "time"), None);
        assert_eq!(unescape("a &amp;&#34;&bogus b&"), "a &\"&bogus b&");
    }
}
