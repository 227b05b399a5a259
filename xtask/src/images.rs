//! `cargo xtask images [--test] [--update-lock]`: builds the driver's two container images with no
//! container engine, straight from files, and with `--test` checks that skopeo reads them and
//! that podman and containerd load and run them.
//!
//! - `ferrovol-controller`: csi-controller, the glibc pieces it links, CA certificates,
//!   /etc/passwd and /etc/group with the user nonroot (65532), /tmp. It runs as 65532.
//! - `ferrovol-node`: csi-node, and csi-controller as well (the local backend runs the controller
//!   beside the node plugin in the node DaemonSet), plus mkfs.ext4, e2fsck, resize2fs, mkfs.xfs,
//!   xfs_growfs, blkid, mount, umount and losetup with exactly the libraries they link, and
//!   /etc/mke2fs.conf. It runs as root.
//!
//! The driver binaries come from `cargo build --profile release --workspace --bins`. Everything
//! else comes from Debian packages fetched with `apt-get download` into `$FERROVOL_CACHE/debs`
//! (default ~/.cache/ferrovol/debs) at the versions pinned in xtask/images.lock, and unpacked
//! with `dpkg-deb`. Only the listed tools, the ELF DT_NEEDED closure of every binary (resolved
//! inside the unpacked packages by the reader below, never against the host's libraries) and a
//! few files written here go into an image. Each package that contributes a file is recorded in
//! /var/lib/dpkg/status.d/ (as distroless does), so image scanners can see it.
//!
//! Output, below the target directory: an OCI image layout per image in `images/<name>/`, with
//! a docker-archive `manifest.json` beside `index.json`, and the same tree as a tar,
//! `images/<name>.tar`, which `podman load`, `skopeo` (oci-archive: and docker-archive:) and
//! `ctr images import` accept. Layers are uncompressed ustar streams with sorted entries, numeric
//! uid/gid 0 and every mtime set to $SOURCE_DATE_EPOCH (default 0), so the same inputs always give
//! the same digests. Every run checks this: it assembles each image a second time, from a second
//! unpacking of the packages, and fails if any digest differs.
//!
//! Layers: `base` (what the driver binaries link, CA certificates, users; byte-identical in both
//! images, so a node stores it once), `tools` (node image only), `app` (the driver binaries).

use crate::{tools, util};
use anyhow::{Context, Result, bail, ensure};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Cargo profile of the driver binaries that go into the images; they are read from
/// `target/<PROFILE>/` (a custom profile's directory carries its name).
pub const PROFILE: &str = util::PROFILE;

/// Pins the Debian packages' versions and hashes; `--update-lock` rewrites it.
const LOCK_FILE: &str = "xtask/images.lock";
/// Below the target directory: the images, scratch space, and the runtime test's files.
const OUT_DIR: &str = "images";
const WORK_DIR: &str = "images-work";
const TEST_DIR: &str = "images-test";

/// Where the images are published (the release workflow) and where the chart looks for them by
/// default (`image.registry` in charts/ferrovol/values.yaml). The archives carry the full name,
/// so `ctr -n k8s.io images import` gives a node exactly the image the chart asks for.
const REGISTRY: &str = "ghcr.io/ferrovol";
const NONROOT: u32 = 65532;
const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MIB: u64 = 1 << 20;

const APT_TIMEOUT: Duration = Duration::from_secs(10 * 60);
const DPKG_TIMEOUT: Duration = Duration::from_secs(2 * 60);
const QUICK_TIMEOUT: Duration = Duration::from_secs(30);
const LOAD_TIMEOUT: Duration = Duration::from_secs(3 * 60);
const PODMAN_TIMEOUT: Duration = Duration::from_secs(2 * 60);
const PROBE_WAIT_SECS: &str = "30";
const PROBE_TIMEOUT: Duration = Duration::from_secs(60);

struct ImageSpec {
    name: &'static str,
    description: &'static str,
    /// Driver binaries from target/<PROFILE>, installed as /usr/bin/<binary>.
    binaries: &'static [&'static str],
    entrypoint: &'static str,
    user: &'static str,
    /// Whether the image carries the `tools` layer.
    tools: bool,
    /// Uncompressed size the image must stay under.
    budget_mib: u64,
}

const IMAGES: [ImageSpec; 2] = [
    ImageSpec {
        name: "ferrovol-controller",
        description: "ferrovol CSI controller plugin (csi-controller)",
        binaries: &["csi-controller"],
        entrypoint: "/usr/bin/csi-controller",
        user: "65532:65532",
        tools: false,
        budget_mib: 25,
    },
    ImageSpec {
        name: "ferrovol-node",
        description: "ferrovol CSI node plugin (csi-node, csi-controller and the filesystem tools)",
        binaries: &["csi-node", "csi-controller"],
        entrypoint: "/usr/bin/csi-node",
        user: "0:0",
        tools: true,
        budget_mib: 60,
    },
];

/// What the node image needs from the Debian packages: the commands csi-node runs, those an
/// operator needs to look at a volume by hand, and the configuration they read.
const NODE_TOOLS: &[&str] = &[
    "/sbin/mkfs.ext4",
    "/sbin/e2fsck",
    "/sbin/resize2fs",
    "/sbin/mkfs.xfs",
    "/usr/sbin/xfs_growfs",
    "/sbin/blkid",
    "/bin/mount",
    "/bin/umount",
    "/sbin/losetup",
];
const NODE_CONFIG: &[&str] = &["/etc/mke2fs.conf"];

/// The Debian packages the images are made from. Each must provide at least one file; a binary
/// that needs a library none of them has fails the build and names the library.
const PACKAGES: &[&str] = &[
    "libc6",
    "libgcc-s1",
    "ca-certificates",
    "e2fsprogs",
    "libext2fs2",
    "libcom-err2",
    "libblkid1",
    "libuuid1",
    "xfsprogs",
    "libinih1",
    "liburcu8",
    "util-linux",
    "mount",
    "libmount1",
    "libselinux1",
    "libpcre2-8-0",
    "libsmartcols1",
];

/// `cargo xtask images [--test] [--update-lock] [--check-reproducible]`.
pub fn run(args: &[String]) -> Result<()> {
    let mut test = false;
    let mut update_lock = false;
    for arg in args {
        match arg.as_str() {
            "--test" => test = true,
            "--update-lock" => update_lock = true,
            // Every build checks it; the flag is accepted for scripts that want to say so.
            "--check-reproducible" => {}
            other => bail!(
                "images: unknown option `{other}` (options: --test, --update-lock, --check-reproducible)"
            ),
        }
    }
    let built = build(update_lock)?;
    if test {
        test_images(&built)?;
    }
    Ok(())
}

/// Builds both images as `cargo xtask images` does and returns their archives
/// (`target/images/<name>.tar`, tagged `ghcr.io/ferrovol/<name>:<appVersion>`): `cargo xtask e2e`
/// imports them into its cluster.
pub(crate) fn build_archives() -> Result<Vec<PathBuf>> {
    Ok(build(false)?.into_iter().map(|b| b.archive).collect())
}

/// The step of `cargo xtask test`: build both images (and the release binaries, once), then run
/// them under podman.
pub fn test() -> Result<()> {
    let built = build(false)?;
    test_images(&built)
}

// ---------------------------------------------------------------------------------------------
// Building

/// One image as written to target/images/.
struct Built {
    spec: &'static ImageSpec,
    reference: String,
    manifest_digest: String,
    config_digest: String,
    layers: Vec<(&'static str, String, u64)>,
    archive: PathBuf,
    archive_sha256: String,
    packages: BTreeSet<String>,
}

impl Built {
    fn uncompressed(&self) -> u64 {
        self.layers.iter().map(|(_, _, size)| size).sum()
    }
}

/// Labels and timestamps shared by both images.
struct Meta {
    version: String,
    revision: String,
    source: String,
    licenses: String,
    epoch: u64,
    created: String,
}

fn build(update_lock: bool) -> Result<Vec<Built>> {
    let started = Instant::now();
    let target = util::target_dir();
    let _lock = lock(&target.join(format!("{OUT_DIR}-build.lock")))?;
    util::run(
        util::cargo().args(["build", "--profile", PROFILE, "--workspace", "--bins"]),
        util::BUILD_TIMEOUT,
    )
    .with_context(|| format!("building the driver binaries (profile {PROFILE})"))?;
    let bin_dir = target.join(PROFILE);
    let meta = Meta::read()?;
    let debs = debian_packages(update_lock)?;

    let work = target.join(WORK_DIR);
    util::fresh_dir(&work)?;
    let out = target.join(OUT_DIR);
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let built = assemble(&debs, &bin_dir, &work.join("unpacked-1"), &out, &meta)?;
    // The reproducibility check: everything again from a second unpacking, into scratch space.
    let again = assemble(
        &debs,
        &bin_dir,
        &work.join("unpacked-2"),
        &work.join("again"),
        &meta,
    )?;
    for (first, second) in built.iter().zip(&again) {
        ensure!(
            first.manifest_digest == second.manifest_digest
                && first.archive_sha256 == second.archive_sha256,
            "{} is not reproducible: two assemblies from the same inputs gave manifests {} and {} \
             (archives sha256:{} and sha256:{}); the second is kept in {}",
            first.spec.name,
            first.manifest_digest,
            second.manifest_digest,
            first.archive_sha256,
            second.archive_sha256,
            work.join("again").display()
        );
    }
    util::remove_dir(&work)?;

    report(&built, &debs, &meta);
    println!(
        "images: built and checked reproducible in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let over: Vec<String> = built
        .iter()
        .filter(|b| b.uncompressed() >= b.spec.budget_mib * MIB)
        .map(|b| {
            format!(
                "{} is {:.1} MiB, over its budget of {} MiB",
                b.spec.name,
                b.uncompressed() as f64 / MIB as f64,
                b.spec.budget_mib
            )
        })
        .collect();
    ensure!(over.is_empty(), "images: {}", over.join("; "));
    Ok(built)
}

fn report(built: &[Built], debs: &[Deb], meta: &Meta) {
    println!(
        "\nimages: version {}, revision {}, created {}",
        meta.version, meta.revision, meta.created
    );
    println!(
        "{:<44} {:>14} {:>7}  digest (manifest)",
        "image", "uncompressed", "layers"
    );
    for b in built {
        println!(
            "{:<44} {:>10.1} MiB {:>7}  {}",
            b.reference,
            b.uncompressed() as f64 / MIB as f64,
            b.layers.len(),
            b.manifest_digest
        );
    }
    for b in built {
        let layers: Vec<String> = b
            .layers
            .iter()
            .map(|(name, _, size)| format!("{name} {:.1} MiB", *size as f64 / MIB as f64))
            .collect();
        println!(
            "  {}: {}; image id {}; {}",
            b.spec.name,
            layers.join(" + "),
            b.config_digest,
            b.archive.display()
        );
    }
    println!("Debian packages (pinned in {LOCK_FILE}):");
    for deb in debs {
        let users: Vec<&str> = built
            .iter()
            .filter(|b| b.packages.contains(&deb.name))
            .map(|b| b.spec.name)
            .collect();
        println!(
            "  {:<18} {:<26} {}",
            deb.name,
            deb.version,
            users.join(", ")
        );
    }
}

impl Meta {
    fn read() -> Result<Meta> {
        let epoch = match std::env::var("SOURCE_DATE_EPOCH") {
            Ok(value) if !value.trim().is_empty() => value
                .trim()
                .parse()
                .with_context(|| format!("SOURCE_DATE_EPOCH={value} is not a number of seconds"))?,
            _ => 0,
        };
        let cargo_toml = std::fs::read_to_string("Cargo.toml").context("reading Cargo.toml")?;
        let field = |key: &str| {
            workspace_package_field(&cargo_toml, key)
                .with_context(|| format!("Cargo.toml has no [workspace.package] {key}"))
        };
        let revision = capture(
            Command::new("git").args(["rev-parse", "HEAD"]),
            QUICK_TIMEOUT,
        )
        .ok()
        .map(|out| out.trim().to_string())
        .filter(|rev| !rev.is_empty())
        .unwrap_or_else(|| "unknown".into());
        Ok(Meta {
            // xtask inherits the workspace version, as the binaries do.
            version: env!("CARGO_PKG_VERSION").to_string(),
            revision,
            source: field("repository")?,
            licenses: field("license")?,
            epoch,
            created: rfc3339(epoch),
        })
    }
}

/// `key = "value"` from the [workspace.package] table of the root Cargo.toml.
fn workspace_package_field(cargo_toml: &str, key: &str) -> Option<String> {
    let mut in_table = false;
    for line in cargo_toml.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_table = line == "[workspace.package]";
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        if in_table && k.trim() == key {
            let v = v.trim();
            return v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .map(str::to_string);
        }
    }
    None
}

/// Unpacks the packages into `staging`, selects the files and writes both images into `out`.
fn assemble(
    debs: &[Deb],
    bin_dir: &Path,
    staging: &Path,
    out: &Path,
    meta: &Meta,
) -> Result<Vec<Built>> {
    let mut pkgs = Packages::unpack(debs, staging)?;

    let driver: Vec<(String, PathBuf)> = IMAGES
        .iter()
        .flat_map(|spec| spec.binaries)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|bin| (format!("/usr/bin/{bin}"), bin_dir.join(bin)))
        .collect();
    for (_, host) in &driver {
        ensure!(
            host.is_file(),
            "{} is missing: the driver binaries were not built",
            host.display()
        );
    }

    let mut base = Tree::default();
    add_closure(&mut pkgs, &mut base, &driver)?;
    add_base_files(&mut pkgs, &mut base)?;

    let mut node_tools = Tree::default();
    let mut tool_roots = Vec::new();
    for path in NODE_TOOLS {
        let host = pkgs.install(path, &mut node_tools)?;
        tool_roots.push((path.to_string(), host));
    }
    add_closure(&mut pkgs, &mut node_tools, &tool_roots)?;
    for path in NODE_CONFIG {
        pkgs.install(path, &mut node_tools)?;
    }
    node_tools.subtract(&base)?;

    let unused: Vec<&str> = pkgs
        .roots
        .iter()
        .map(|p| p.name.as_str())
        .filter(|name| !base.packages().contains(*name) && !node_tools.packages().contains(*name))
        .collect();
    ensure!(
        unused.is_empty(),
        "Debian package(s) {} provide no file to any image: remove them from PACKAGES in \
         xtask/src/images.rs and run `cargo xtask images --update-lock`",
        unused.join(", ")
    );
    pkgs.add_status_files(&mut base)?;
    pkgs.add_status_files(&mut node_tools)?;
    let base_layer = base.layer(meta.epoch)?;
    let tools_layer = node_tools.layer(meta.epoch)?;

    let mut built = Vec::new();
    for spec in &IMAGES {
        let mut app = Tree::default();
        for bin in spec.binaries {
            let host = bin_dir.join(bin);
            app.insert(
                &format!("/usr/bin/{bin}"),
                Entry::File {
                    source: Source::Host(host),
                    mode: 0o755,
                },
                None,
            )?;
        }
        let mut layers = vec![("base", base_layer.clone())];
        let mut packages = base.packages();
        if spec.tools {
            layers.push(("tools", tools_layer.clone()));
            packages.extend(node_tools.packages());
        }
        layers.push(("app", app.layer(meta.epoch)?));
        built.push(write_image(spec, &layers, packages, meta, out)?);
    }
    Ok(built)
}

/// Users, groups, name service configuration, CA certificates and the writable directories.
fn add_base_files(pkgs: &mut Packages, tree: &mut Tree) -> Result<()> {
    let text = |s: &str| Entry::File {
        source: Source::Bytes(s.as_bytes().to_vec()),
        mode: 0o644,
    };
    tree.insert(
        "/etc/passwd",
        text(&format!(
            "root:x:0:0:root:/root:/sbin/nologin\n\
             nonroot:x:{NONROOT}:{NONROOT}:nonroot:/home/nonroot:/sbin/nologin\n"
        )),
        None,
    )?;
    tree.insert(
        "/etc/group",
        text(&format!("root:x:0:\nnonroot:x:{NONROOT}:\n")),
        None,
    )?;
    tree.insert(
        "/etc/nsswitch.conf",
        text("passwd: files\ngroup: files\nhosts: files dns\n"),
        None,
    )?;
    tree.insert(
        "/tmp",
        Entry::Dir {
            mode: 0o1777,
            uid: 0,
        },
        None,
    )?;
    tree.insert(
        "/root",
        Entry::Dir {
            mode: 0o700,
            uid: 0,
        },
        None,
    )?;
    tree.insert(
        "/home/nonroot",
        Entry::Dir {
            mode: 0o700,
            uid: NONROOT,
        },
        None,
    )?;
    // update-ca-certificates would build the bundle at install time: the same concatenation of
    // Mozilla's certificates, in name order, each ending with a newline.
    let (pkg, dir) = pkgs.find_dir("/usr/share/ca-certificates/mozilla")?;
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    names.retain(|p| p.extension().is_some_and(|e| e == "crt"));
    names.sort();
    ensure!(!names.is_empty(), "{} holds no certificate", dir.display());
    let mut bundle = Vec::new();
    for cert in &names {
        let pem = std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
        bundle.extend_from_slice(&pem);
        if !pem.ends_with(b"\n") {
            bundle.push(b'\n');
        }
    }
    tree.insert(
        "/etc/ssl/certs/ca-certificates.crt",
        Entry::File {
            source: Source::Bytes(bundle),
            mode: 0o644,
        },
        Some(&pkg),
    )
}

/// Adds the dynamic loader and the DT_NEEDED closure of `roots` (image path, file) to `tree`,
/// every library resolved inside the packages the way ld.so would search them.
fn add_closure(pkgs: &mut Packages, tree: &mut Tree, roots: &[(String, PathBuf)]) -> Result<()> {
    let mut queue: Vec<(String, PathBuf)> = roots.to_vec();
    let mut seen = BTreeSet::new();
    while let Some((path, host)) = queue.pop() {
        if !seen.insert(host.clone()) {
            continue;
        }
        let data = std::fs::read(&host).with_context(|| format!("reading {}", host.display()))?;
        let elf = Elf::parse(&data).with_context(|| {
            format!(
                "{path} ({}) cannot go into an image (no shell there to run a script)",
                host.display()
            )
        })?;
        if let Some(interp) = elf.interp {
            let found = pkgs.install(&interp, tree)?;
            queue.push((interp, found));
        }
        for soname in elf.needed {
            let Some(lib) = pkgs.find_library(&soname)? else {
                let hint = host_package_of(&soname)
                    .map(|pkg| format!(" (on this machine, Debian's `{pkg}` has it)"))
                    .unwrap_or_default();
                bail!(
                    "{path} needs {soname}, which none of the Debian packages provides{hint}: add \
                     the package that ships it to PACKAGES in xtask/src/images.rs and run \
                     `cargo xtask images --update-lock`"
                );
            };
            let found = pkgs.install(&lib, tree)?;
            queue.push((lib, found));
        }
    }
    Ok(())
}

/// The installed Debian package shipping a file named `soname`, for error messages.
fn host_package_of(soname: &str) -> Option<String> {
    let out = capture(
        Command::new("dpkg").args(["-S", &format!("*/{soname}")]),
        QUICK_TIMEOUT,
    )
    .ok()?;
    let pkg = out.lines().next()?.split(':').next()?.trim().to_string();
    (!pkg.is_empty()).then_some(pkg)
}

// ---------------------------------------------------------------------------------------------
// Debian packages

struct Deb {
    name: String,
    version: String,
    arch: String,
    sha256: String,
    path: PathBuf,
}

impl Deb {
    /// The file name apt-get download gives a package (`:` of an epoch becomes `%3a`).
    fn file_name(name: &str, version: &str, arch: &str) -> String {
        format!("{name}_{}_{arch}.deb", version.replace(':', "%3a"))
    }

    /// (name, version, arch) from such a file name.
    fn parse_file_name(file: &str) -> Option<(String, String, String)> {
        let stem = file.strip_suffix(".deb")?;
        let mut parts = stem.split('_');
        let (name, version, arch) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let version = version.replace("%3a", ":").replace("%3A", ":");
        Some((name.into(), version, arch.into()))
    }
}

/// The packages of [`PACKAGES`] at the versions of the lock file, downloaded into the cache if
/// they are not there yet. With `update` (or without a lock file), Debian's current versions are
/// taken and the lock file is rewritten.
fn debian_packages(update: bool) -> Result<Vec<Deb>> {
    let cache = tools::cache_dir()?.join("debs");
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("cannot create {}", cache.display()))?;
    let lock = match std::fs::read_to_string(LOCK_FILE) {
        Ok(text) => Some(parse_lock(&text)?),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => None,
        Err(err) => return Err(err).with_context(|| format!("reading {LOCK_FILE}")),
    };
    let wanted: BTreeSet<&str> = PACKAGES.iter().copied().collect();
    let Some(locked) = lock.filter(|_| !update) else {
        return update_lock(&cache);
    };
    let in_lock: BTreeSet<&str> = locked.iter().map(|(name, ..)| name.as_str()).collect();
    ensure!(
        in_lock == wanted,
        "{LOCK_FILE} does not list the packages of PACKAGES in xtask/src/images.rs: run `cargo \
         xtask images --update-lock`"
    );
    let debs: Vec<Deb> = locked
        .into_iter()
        .map(|(name, version, arch, sha256)| Deb {
            path: cache.join(Deb::file_name(&name, &version, &arch)),
            name,
            version,
            arch,
            sha256,
        })
        .collect();
    let missing: Vec<String> = debs
        .iter()
        .filter(|deb| sha256_file(&deb.path).ok().as_ref() != Some(&deb.sha256))
        .map(|deb| format!("{}={}", deb.name, deb.version))
        .collect();
    if !missing.is_empty() {
        println!(
            "images: downloading {} pinned Debian package(s) into {}",
            missing.len(),
            cache.display()
        );
        apt_download(&cache, &missing).context(
            "the pinned versions could not be downloaded; Debian may have replaced them (a point \
             release or security update): run `cargo xtask images --update-lock` to pin the \
             current ones",
        )?;
    }
    for deb in &debs {
        let got = sha256_file(&deb.path)?;
        ensure!(
            got == deb.sha256,
            "{} has sha256 {got}, but {LOCK_FILE} pins {}: Debian served a different file under \
             the same version",
            deb.path.display(),
            deb.sha256
        );
    }
    Ok(debs)
}

/// `apt-get download` of Debian's current versions of every package, and a new lock file.
fn update_lock(cache: &Path) -> Result<Vec<Deb>> {
    println!("images: pinning Debian's current versions of the image packages in {LOCK_FILE}");
    apt_update()?;
    let scratch = cache.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)
        .with_context(|| format!("cannot create {}", scratch.display()))?;
    let result = (|| {
        let names: Vec<String> = PACKAGES.iter().map(|p| p.to_string()).collect();
        apt_download(&scratch, &names)?;
        let mut debs = Vec::new();
        for entry in std::fs::read_dir(&scratch)? {
            let file = entry?.file_name().to_string_lossy().into_owned();
            let (name, version, arch) = Deb::parse_file_name(&file)
                .with_context(|| format!("apt-get download wrote an unexpected file, {file}"))?;
            let path = cache.join(&file);
            std::fs::rename(scratch.join(&file), &path)
                .with_context(|| format!("cannot move {file} into {}", cache.display()))?;
            debs.push(Deb {
                sha256: sha256_file(&path)?,
                name,
                version,
                arch,
                path,
            });
        }
        let mut order: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, name) in PACKAGES.iter().enumerate() {
            order.insert(name, i);
        }
        debs.sort_by_key(|deb| order.get(deb.name.as_str()).copied());
        let got: BTreeSet<&str> = debs.iter().map(|d| d.name.as_str()).collect();
        let wanted: BTreeSet<&str> = PACKAGES.iter().copied().collect();
        ensure!(
            got == wanted,
            "apt-get download fetched {got:?}, expected {wanted:?}"
        );
        Ok(debs)
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    let debs = result?;
    let mut text = String::from(
        "# Debian packages that `cargo xtask images` puts into the container images, pinned.\n\
         # `cargo xtask images --update-lock` takes Debian's current versions and rewrites this.\n\
         # package version architecture sha256\n",
    );
    for deb in &debs {
        let _ = writeln!(
            text,
            "{} {} {} {}",
            deb.name, deb.version, deb.arch, deb.sha256
        );
    }
    std::fs::write(LOCK_FILE, text).with_context(|| format!("writing {LOCK_FILE}"))?;
    println!("images: wrote {LOCK_FILE}");
    Ok(debs)
}

type Locked = (String, String, String, String);

fn parse_lock(text: &str) -> Result<Vec<Locked>> {
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, version, arch, sha256] = fields.as_slice() else {
            bail!(
                "{LOCK_FILE}:{}: expected `package version architecture sha256`",
                n + 1
            );
        };
        ensure!(
            sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_hexdigit()),
            "{LOCK_FILE}:{}: bad sha256",
            n + 1
        );
        entries.push((
            name.to_string(),
            version.to_string(),
            arch.to_string(),
            sha256.to_ascii_lowercase(),
        ));
    }
    Ok(entries)
}

/// `apt-get download` into `dir`; after one `apt-get update` if the first attempt fails (a fresh
/// machine has no package lists).
fn apt_download(dir: &Path, packages: &[String]) -> Result<()> {
    let download = || {
        util::run(
            Command::new("apt-get")
                .args(["download", "-q", "-o", "APT::Sandbox::User=root"])
                .args(packages)
                .current_dir(dir),
            APT_TIMEOUT,
        )
    };
    if download().is_ok() {
        return Ok(());
    }
    apt_update()?;
    download().context("apt-get download")
}

fn apt_update() -> Result<()> {
    util::run(Command::new("apt-get").args(["update", "-qq"]), APT_TIMEOUT)
        .context("apt-get update")
}

struct PackageRoot {
    name: String,
    /// The unpacked package (canonical path), with its control files in DEBIAN/.
    root: PathBuf,
}

/// Unpacked packages, searched in order as if they were installed together.
struct Packages {
    roots: Vec<PackageRoot>,
    lib_dirs: Vec<String>,
}

impl Packages {
    fn unpack(debs: &[Deb], staging: &Path) -> Result<Packages> {
        util::fresh_dir(staging)?;
        let mut roots = Vec::new();
        for deb in debs {
            let root = staging.join(&deb.name);
            util::run(
                Command::new("dpkg-deb").arg("-R").arg(&deb.path).arg(&root),
                DPKG_TIMEOUT,
            )
            .with_context(|| format!("unpacking {}", deb.path.display()))?;
            roots.push(PackageRoot {
                name: deb.name.clone(),
                root: root.canonicalize()?,
            });
        }
        let triplet = multiarch_triplet()?;
        // ld.so's built-in search path on Debian, used when there is no /etc/ld.so.cache.
        let lib_dirs = vec![
            format!("/lib/{triplet}"),
            format!("/usr/lib/{triplet}"),
            "/lib".into(),
            "/usr/lib".into(),
        ];
        Ok(Packages { roots, lib_dirs })
    }

    /// The package (index) holding the absolute, normalized `path`, its file and metadata
    /// (not following a final symlink).
    fn lookup(&self, path: &str) -> Result<Option<(usize, PathBuf, std::fs::Metadata)>> {
        let rel = path.trim_start_matches('/');
        for (i, pkg) in self.roots.iter().enumerate() {
            let candidate = pkg.root.join(rel);
            let Ok(meta) = candidate.symlink_metadata() else {
                continue;
            };
            // A symlinked directory on the way would resolve outside the package.
            if let Some(parent) = candidate.parent() {
                ensure!(
                    parent.canonicalize()? == parent,
                    "{path} in {} lies below a symlinked directory, which is not supported",
                    pkg.name
                );
            }
            return Ok(Some((i, candidate, meta)));
        }
        Ok(None)
    }

    fn find_dir(&self, path: &str) -> Result<(String, PathBuf)> {
        match self.lookup(path)? {
            Some((i, dir, meta)) if meta.is_dir() => Ok((self.roots[i].name.clone(), dir)),
            _ => bail!("no Debian package provides the directory {path}"),
        }
    }

    /// The image path of the library `soname`, searched like ld.so does.
    fn find_library(&self, soname: &str) -> Result<Option<String>> {
        ensure!(!soname.contains('/'), "DT_NEEDED entry {soname} is a path");
        for dir in &self.lib_dirs {
            let path = format!("{dir}/{soname}");
            if self.lookup(&path)?.is_some() {
                return Ok(Some(path));
            }
        }
        Ok(None)
    }

    /// Adds `path` to `tree` as the packages have it, following symlinks (each link goes in too),
    /// and returns the file finally reached.
    fn install(&mut self, path: &str, tree: &mut Tree) -> Result<PathBuf> {
        let mut path = normalize("/", path)?;
        for _ in 0..40 {
            let (i, host, meta) = self
                .lookup(&path)?
                .with_context(|| format!("no Debian package provides {path}"))?;
            let pkg = self.roots[i].name.clone();
            if meta.file_type().is_symlink() {
                let target = std::fs::read_link(&host)?;
                let target = target
                    .to_str()
                    .with_context(|| format!("{path}: symlink target is not UTF-8"))?
                    .to_string();
                tree.insert(&path, Entry::Symlink(target.clone()), Some(&pkg))?;
                path = normalize(parent(&path), &target)?;
                continue;
            }
            ensure!(meta.is_file(), "{path} in {pkg} is not a regular file");
            tree.insert(
                &path,
                Entry::File {
                    source: Source::Host(host.clone()),
                    // No setuid or setgid bit: nothing in the images changes user.
                    mode: meta.permissions().mode() & 0o777,
                },
                Some(&pkg),
            )?;
            return Ok(host);
        }
        bail!("{path}: too many levels of symbolic links")
    }

    /// /var/lib/dpkg/status.d/<package>: the control file of every package that contributes to
    /// `tree`, where image scanners look for a distroless image's packages.
    fn add_status_files(&self, tree: &mut Tree) -> Result<()> {
        for name in tree.packages() {
            let pkg = self
                .roots
                .iter()
                .find(|p| p.name == name)
                .context("package provenance")?;
            let control = pkg.root.join("DEBIAN/control");
            let text = std::fs::read(&control)
                .with_context(|| format!("reading {}", control.display()))?;
            tree.insert(
                &format!("/var/lib/dpkg/status.d/{name}"),
                Entry::File {
                    source: Source::Bytes(text),
                    mode: 0o644,
                },
                Some(&name),
            )?;
        }
        Ok(())
    }
}

/// Debian's multiarch directory name for the machine the images are built on (and for).
fn multiarch_triplet() -> Result<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" => Ok("x86_64-linux-gnu"),
        "aarch64" => Ok("aarch64-linux-gnu"),
        other => bail!("images: unsupported architecture {other}"),
    }
}

fn oci_architecture() -> Result<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" => Ok("amd64"),
        "aarch64" => Ok("arm64"),
        other => bail!("images: unsupported architecture {other}"),
    }
}

/// `target` resolved against the directory `base` (both absolute image paths), lexically.
fn normalize(base: &str, target: &str) -> Result<String> {
    let mut parts: Vec<&str> = Vec::new();
    let joined = if target.starts_with('/') {
        target.to_string()
    } else {
        format!("{base}/{target}")
    };
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            part => parts.push(part),
        }
    }
    ensure!(!parts.is_empty(), "{target} resolves to /");
    Ok(format!("/{}", parts.join("/")))
}

fn parent(path: &str) -> &str {
    match path.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &path[..i],
    }
}

// ---------------------------------------------------------------------------------------------
// File trees and layers

#[derive(Clone, PartialEq)]
enum Source {
    Host(PathBuf),
    Bytes(Vec<u8>),
}

#[derive(Clone, PartialEq)]
enum Entry {
    Dir { mode: u32, uid: u32 },
    File { source: Source, mode: u32 },
    Symlink(String),
}

/// The content of one layer: absolute image paths, and the package each entry came from.
#[derive(Default)]
struct Tree(BTreeMap<String, (Entry, Option<String>)>);

impl Tree {
    fn insert(&mut self, path: &str, entry: Entry, pkg: Option<&str>) -> Result<()> {
        ensure!(
            path.starts_with('/') && path.len() > 1 && !path.ends_with('/'),
            "bad image path {path}"
        );
        match self.0.get(path) {
            Some((existing, _)) if *existing == entry => Ok(()),
            Some(_) => bail!("{path} would go into the image twice, with different contents"),
            None => {
                self.0
                    .insert(path.to_string(), (entry, pkg.map(str::to_string)));
                Ok(())
            }
        }
    }

    /// Drops what `lower` already provides (a lower layer); the two must agree on it.
    fn subtract(&mut self, lower: &Tree) -> Result<()> {
        for (path, (entry, _)) in &lower.0 {
            if let Some((mine, _)) = self.0.get(path) {
                ensure!(
                    mine == entry,
                    "{path} differs between the base and tools layers"
                );
                self.0.remove(path);
            }
        }
        Ok(())
    }

    fn packages(&self) -> BTreeSet<String> {
        self.0.values().filter_map(|(_, pkg)| pkg.clone()).collect()
    }

    /// The layer: an uncompressed tar with every parent directory, entries sorted by name.
    fn layer(&self, mtime: u64) -> Result<Vec<u8>> {
        let mut entries: BTreeMap<String, &Entry> = BTreeMap::new();
        const DIR: Entry = Entry::Dir {
            mode: 0o755,
            uid: 0,
        };
        for (path, (entry, _)) in &self.0 {
            let name = path.trim_start_matches('/');
            let name = match entry {
                Entry::Dir { .. } => format!("{name}/"),
                _ => name.to_string(),
            };
            entries.insert(name, entry);
        }
        for path in self.0.keys() {
            let mut dir = parent(path);
            while dir != "/" {
                entries
                    .entry(format!("{}/", dir.trim_start_matches('/')))
                    .or_insert(&DIR);
                dir = parent(dir);
            }
        }
        let mut tar = TarWriter::new(Vec::new(), mtime);
        for (name, entry) in entries {
            match entry {
                Entry::Dir { mode, uid } => tar.dir(&name, *mode, *uid)?,
                Entry::Symlink(target) => tar.symlink(&name, target)?,
                Entry::File { source, mode } => {
                    let data = match source {
                        Source::Bytes(bytes) => bytes.clone(),
                        Source::Host(path) => std::fs::read(path)
                            .with_context(|| format!("reading {}", path.display()))?,
                    };
                    tar.file(&name, *mode, &data)?;
                }
            }
        }
        tar.finish()
    }
}

// ---------------------------------------------------------------------------------------------
// OCI image layout and archive

const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn sha256_file(path: &Path) -> Result<String> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(sha256_hex(&data))
}

fn descriptor(media_type: &str, data: &[u8]) -> String {
    format!(
        r#"{{"mediaType":{},"digest":"sha256:{}","size":{}}}"#,
        json_str(media_type),
        sha256_hex(data),
        data.len()
    )
}

/// Writes `out/<name>/` (OCI layout + docker-archive manifest.json) and `out/<name>.tar`.
fn write_image(
    spec: &'static ImageSpec,
    layers: &[(&'static str, Vec<u8>)],
    packages: BTreeSet<String>,
    meta: &Meta,
    out: &Path,
) -> Result<Built> {
    let reference = format!("{REGISTRY}/{}:{}", spec.name, meta.version);
    let labels: BTreeMap<&str, &str> = [
        ("org.opencontainers.image.created", meta.created.as_str()),
        ("org.opencontainers.image.description", spec.description),
        ("org.opencontainers.image.licenses", meta.licenses.as_str()),
        ("org.opencontainers.image.revision", meta.revision.as_str()),
        ("org.opencontainers.image.source", meta.source.as_str()),
        ("org.opencontainers.image.title", spec.name),
        ("org.opencontainers.image.version", meta.version.as_str()),
    ]
    .into();
    let labels_json = json_map(&labels);

    let layer_digests: Vec<String> = layers
        .iter()
        .map(|(_, data)| format!("sha256:{}", sha256_hex(data)))
        .collect();
    let history: Vec<String> = layers
        .iter()
        .map(|(name, _)| {
            format!(
                r#"{{"created":{},"created_by":{}}}"#,
                json_str(&meta.created),
                json_str(&format!("cargo xtask images: {name} layer"))
            )
        })
        .collect();
    let config = format!(
        r#"{{"architecture":{},"config":{{"Entrypoint":[{}],"Env":[{}],"Labels":{},"User":{},"WorkingDir":"/"}},"created":{},"history":[{}],"os":"linux","rootfs":{{"diff_ids":[{}],"type":"layers"}}}}"#,
        json_str(oci_architecture()?),
        json_str(spec.entrypoint),
        json_str(PATH_ENV),
        labels_json,
        json_str(spec.user),
        json_str(&meta.created),
        history.join(","),
        layer_digests
            .iter()
            .map(|d| json_str(d))
            .collect::<Vec<_>>()
            .join(","),
    );
    let layer_data: Vec<&[u8]> = layers.iter().map(|(_, data)| data.as_slice()).collect();
    let OciFiles {
        files,
        manifest_digest,
        config_digest,
    } = oci_files(
        &reference,
        &meta.version,
        &config,
        &layer_data,
        &labels_json,
    );

    let layout = out.join(spec.name);
    if layout.exists() {
        std::fs::remove_dir_all(&layout)
            .with_context(|| format!("cannot remove {}", layout.display()))?;
    }
    std::fs::create_dir_all(layout.join("blobs/sha256"))
        .with_context(|| format!("cannot create {}", layout.display()))?;
    let mut tar = TarWriter::new(Vec::new(), meta.epoch);
    tar.dir("blobs/", 0o755, 0)?;
    tar.dir("blobs/sha256/", 0o755, 0)?;
    for (name, data) in &files {
        std::fs::write(layout.join(name), data)
            .with_context(|| format!("writing {}", layout.join(name).display()))?;
        tar.file(name, 0o644, data)?;
    }
    let archive_bytes = tar.finish()?;
    let archive = out.join(format!("{}.tar", spec.name));
    let partial = out.join(format!("{}.tar.partial", spec.name));
    std::fs::write(&partial, &archive_bytes)
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, &archive)
        .with_context(|| format!("writing {}", archive.display()))?;

    Ok(Built {
        spec,
        reference,
        manifest_digest,
        config_digest,
        layers: layers
            .iter()
            .zip(layer_digests)
            .map(|((name, data), digest)| (*name, digest, data.len() as u64))
            .collect(),
        archive,
        archive_sha256: sha256_hex(&archive_bytes),
        packages,
    })
}

/// The files of an OCI image layout (plus a docker-archive `manifest.json` pointing at the same
/// blobs) for one image: `config` is its config JSON, `annotations` a JSON object for the
/// manifest, `tag` the OCI reference name.
struct OciFiles {
    files: BTreeMap<String, Vec<u8>>,
    manifest_digest: String,
    config_digest: String,
}

fn oci_files(
    reference: &str,
    tag: &str,
    config: &str,
    layers: &[&[u8]],
    annotations: &str,
) -> OciFiles {
    let layer_digests: Vec<String> = layers
        .iter()
        .map(|data| format!("sha256:{}", sha256_hex(data)))
        .collect();
    let manifest = format!(
        r#"{{"schemaVersion":2,"mediaType":{},"config":{},"layers":[{}],"annotations":{}}}"#,
        json_str(MANIFEST_TYPE),
        descriptor(CONFIG_TYPE, config.as_bytes()),
        layers
            .iter()
            .map(|data| descriptor(LAYER_TYPE, data))
            .collect::<Vec<_>>()
            .join(","),
        annotations,
    );
    let manifest_digest = format!("sha256:{}", sha256_hex(manifest.as_bytes()));
    let config_digest = format!("sha256:{}", sha256_hex(config.as_bytes()));
    // Annotated as Docker 25's `docker save` does, which containerd, podman and skopeo all read:
    // the full name for containerd and podman, the tag as the OCI reference name.
    let index = format!(
        r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{{"mediaType":{},"digest":{},"size":{},"annotations":{{"io.containerd.image.name":{},"org.opencontainers.image.ref.name":{}}}}}]}}"#,
        json_str(MANIFEST_TYPE),
        json_str(&manifest_digest),
        manifest.len(),
        json_str(reference),
        json_str(tag),
    );
    let blob_path = |digest: &str| format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"));
    // docker-archive's manifest, pointing at the same blobs.
    let docker_manifest = format!(
        r#"[{{"Config":{},"RepoTags":[{}],"Layers":[{}]}}]"#,
        json_str(&blob_path(&config_digest)),
        json_str(reference),
        layer_digests
            .iter()
            .map(|d| json_str(&blob_path(d)))
            .collect::<Vec<_>>()
            .join(","),
    );

    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (digest, data) in layer_digests.iter().zip(layers) {
        files.insert(blob_path(digest), data.to_vec());
    }
    files.insert(blob_path(&config_digest), config.as_bytes().to_vec());
    files.insert(blob_path(&manifest_digest), manifest.into_bytes());
    files.insert("index.json".into(), index.into_bytes());
    files.insert("manifest.json".into(), docker_manifest.into_bytes());
    files.insert(
        "oci-layout".into(),
        br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
    );
    OciFiles {
        files,
        manifest_digest,
        config_digest,
    }
}

/// What goes into a [`write_simple_image`] layer at one absolute path.
pub enum SimpleEntry {
    /// A file copied from the host, with this mode.
    Host(PathBuf, u32),
    /// A file with these contents and this mode.
    Bytes(Vec<u8>, u32),
    Symlink(String),
    Dir(u32),
}

/// Writes `archive`: a one-layer image named `reference` (`ctr images import` and `podman load`
/// read it) holding `files`, with `entrypoint` (may be empty) and every mtime 0. For test
/// infrastructure such as `cargo xtask cluster`'s pause, busybox and sidecar images.
pub fn write_simple_image(
    reference: &str,
    entrypoint: &[&str],
    files: &[(String, SimpleEntry)],
    archive: &Path,
) -> Result<()> {
    let mut tree = Tree::default();
    for (path, entry) in files {
        let entry = match entry {
            SimpleEntry::Host(from, mode) => Entry::File {
                source: Source::Host(from.clone()),
                mode: *mode,
            },
            SimpleEntry::Bytes(data, mode) => Entry::File {
                source: Source::Bytes(data.clone()),
                mode: *mode,
            },
            SimpleEntry::Symlink(target) => Entry::Symlink(target.clone()),
            SimpleEntry::Dir(mode) => Entry::Dir {
                mode: *mode,
                uid: 0,
            },
        };
        tree.insert(path, entry, None)?;
    }
    let layer = tree.layer(0)?;
    let created = rfc3339(0);
    let entrypoint = if entrypoint.is_empty() {
        String::new()
    } else {
        let args: Vec<String> = entrypoint.iter().map(|a| json_str(a)).collect();
        format!(r#""Entrypoint":[{}],"#, args.join(","))
    };
    let config = format!(
        r#"{{"architecture":{},"config":{{{entrypoint}"Env":[{}],"WorkingDir":"/"}},"created":{},"history":[{{"created":{},"created_by":"cargo xtask"}}],"os":"linux","rootfs":{{"diff_ids":[{}],"type":"layers"}}}}"#,
        json_str(oci_architecture()?),
        json_str(PATH_ENV),
        json_str(&created),
        json_str(&created),
        json_str(&format!("sha256:{}", sha256_hex(&layer))),
    );
    let tag = reference.rsplit_once(':').map_or("latest", |(_, tag)| tag);
    let oci = oci_files(reference, tag, &config, &[&layer], "{}");
    let mut tar = TarWriter::new(Vec::new(), 0);
    tar.dir("blobs/", 0o755, 0)?;
    tar.dir("blobs/sha256/", 0o755, 0)?;
    for (name, data) in &oci.files {
        tar.file(name, 0o644, data)?;
    }
    let bytes = tar.finish()?;
    let partial = archive.with_extension("tar.partial");
    std::fs::write(&partial, &bytes).with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, archive).with_context(|| format!("writing {}", archive.display()))
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_map(map: &BTreeMap<&str, &str>) -> String {
    let pairs: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
        .collect();
    format!("{{{}}}", pairs.join(","))
}

/// `epoch` (seconds since 1970, UTC) as RFC 3339, e.g. 2023-11-14T22:13:20Z.
fn rfc3339(epoch: u64) -> String {
    let days = (epoch / 86_400) as i64;
    let secs = epoch % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

// ---------------------------------------------------------------------------------------------
// ustar

/// Writes a POSIX ustar stream: numeric owner only (uid = gid, no user names), one mtime.
struct TarWriter<W: std::io::Write> {
    out: W,
    mtime: u64,
}

impl<W: std::io::Write> TarWriter<W> {
    fn new(out: W, mtime: u64) -> Self {
        TarWriter { out, mtime }
    }

    fn dir(&mut self, name: &str, mode: u32, uid: u32) -> Result<()> {
        ensure!(name.ends_with('/'), "tar: directory {name} must end with /");
        let header = ustar_header(name, b'5', mode, uid, 0, self.mtime, "")?;
        self.out.write_all(&header)?;
        Ok(())
    }

    fn symlink(&mut self, name: &str, target: &str) -> Result<()> {
        let header = ustar_header(name, b'2', 0o777, 0, 0, self.mtime, target)?;
        self.out.write_all(&header)?;
        Ok(())
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> Result<()> {
        let header = ustar_header(name, b'0', mode, 0, data.len() as u64, self.mtime, "")?;
        self.out.write_all(&header)?;
        self.out.write_all(data)?;
        let pad = (512 - data.len() % 512) % 512;
        self.out.write_all(&[0; 512][..pad])?;
        Ok(())
    }

    fn finish(mut self) -> Result<W> {
        self.out.write_all(&[0; 1024])?;
        Ok(self.out)
    }
}

fn ustar_header(
    name: &str,
    kind: u8,
    mode: u32,
    uid: u32,
    size: u64,
    mtime: u64,
    link: &str,
) -> Result<[u8; 512]> {
    let mut h = [0u8; 512];
    let (prefix, name) = split_name(name)?;
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], u64::from(mode))?;
    octal(&mut h[108..116], u64::from(uid))?;
    octal(&mut h[116..124], u64::from(uid))?;
    octal(&mut h[124..136], size)?;
    octal(&mut h[136..148], mtime)?;
    h[148..156].fill(b' ');
    h[156] = kind;
    ensure!(
        link.len() <= 100,
        "tar: link target {link} is longer than 100 bytes"
    );
    h[157..157 + link.len()].copy_from_slice(link.as_bytes());
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0)?;
    octal(&mut h[337..345], 0)?;
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    Ok(h)
}

/// ustar keeps names of up to 100 bytes, or a prefix of up to 155 bytes and a `/`.
fn split_name(name: &str) -> Result<(&str, &str)> {
    if name.len() <= 100 {
        return Ok(("", name));
    }
    for (i, _) in name.match_indices('/') {
        let (prefix, rest) = (&name[..i], &name[i + 1..]);
        if prefix.len() <= 155 && !rest.is_empty() && rest.len() <= 100 {
            return Ok((prefix, rest));
        }
    }
    bail!("tar: {name} is too long for a ustar header")
}

fn octal(field: &mut [u8], value: u64) -> Result<()> {
    let width = field.len() - 1;
    let digits = format!("{value:0width$o}");
    ensure!(
        digits.len() == width,
        "tar: {value} does not fit a header field"
    );
    field[..width].copy_from_slice(digits.as_bytes());
    field[width] = 0;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// ELF

/// What the dynamic loader reads from a 64-bit little-endian ELF file.
struct Elf {
    interp: Option<String>,
    needed: Vec<String>,
}

impl Elf {
    fn parse(data: &[u8]) -> Result<Elf> {
        ensure!(data.starts_with(b"\x7fELF"), "not an ELF file");
        ensure!(
            data.len() >= 64 && data[4] == 2 && data[5] == 1,
            "not a 64-bit little-endian ELF file"
        );
        let bytes = |at: u64, len: u64| -> Result<&[u8]> {
            let start = usize::try_from(at)?;
            let end = start
                .checked_add(usize::try_from(len)?)
                .context("ELF offset overflow")?;
            data.get(start..end)
                .with_context(|| format!("ELF: {len} bytes at {at} lie beyond the file"))
        };
        let u16_at = |at: u64| -> Result<u64> {
            Ok(u64::from(u16::from_le_bytes(bytes(at, 2)?.try_into()?)))
        };
        let u32_at = |at: u64| -> Result<u64> {
            Ok(u64::from(u32::from_le_bytes(bytes(at, 4)?.try_into()?)))
        };
        let u64_at = |at: u64| -> Result<u64> { Ok(u64::from_le_bytes(bytes(at, 8)?.try_into()?)) };
        let c_str = |at: u64| -> Result<String> {
            let start = usize::try_from(at)?;
            let tail = data.get(start..).context("ELF: string beyond the file")?;
            let end = tail
                .iter()
                .position(|&b| b == 0)
                .context("ELF: unterminated string")?;
            Ok(std::str::from_utf8(&tail[..end])?.to_string())
        };

        let (phoff, phentsize, phnum) = (u64_at(0x20)?, u16_at(0x36)?, u16_at(0x38)?);
        let mut loads = Vec::new();
        let mut dynamic = None;
        let mut interp = None;
        for i in 0..phnum {
            let ph = phoff + i * phentsize;
            let (offset, vaddr, filesz) = (u64_at(ph + 8)?, u64_at(ph + 16)?, u64_at(ph + 32)?);
            match u32_at(ph)? {
                1 => loads.push((vaddr, offset, filesz)), // PT_LOAD
                2 => dynamic = Some((offset, filesz)),    // PT_DYNAMIC
                3 => interp = Some(c_str(offset)?),       // PT_INTERP
                _ => {}
            }
        }
        let Some((dyn_offset, dyn_size)) = dynamic else {
            return Ok(Elf {
                interp,
                needed: Vec::new(),
            });
        };
        let mut needed_at = Vec::new();
        let mut strtab = None;
        for i in 0..dyn_size / 16 {
            let entry = dyn_offset + i * 16;
            let (tag, value) = (u64_at(entry)?, u64_at(entry + 8)?);
            match tag {
                0 => break,                 // DT_NULL
                1 => needed_at.push(value), // DT_NEEDED
                5 => strtab = Some(value),  // DT_STRTAB
                15 | 29 => bail!("ELF: RPATH/RUNPATH is not supported"),
                _ => {}
            }
        }
        if needed_at.is_empty() {
            return Ok(Elf {
                interp,
                needed: Vec::new(),
            });
        }
        let strtab = strtab.context("ELF: DT_NEEDED without DT_STRTAB")?;
        let strtab = loads
            .iter()
            .find(|(vaddr, _, filesz)| (*vaddr..vaddr + filesz).contains(&strtab))
            .map(|(vaddr, offset, _)| strtab - vaddr + offset)
            .context("ELF: DT_STRTAB lies in no loaded segment")?;
        let needed = needed_at
            .into_iter()
            .map(|at| c_str(strtab + at))
            .collect::<Result<_>>()?;
        Ok(Elf { interp, needed })
    }
}

// ---------------------------------------------------------------------------------------------
// Running the images: podman, skopeo

/// Podman with a storage and configuration of its own under target/images-test/, so that the
/// test neither sees nor touches the machine's images and containers.
struct Podman {
    conf: PathBuf,
    storage_conf: PathBuf,
}

const CONTROLLER_CONTAINER: &str = "ferrovol-images-test-controller";
const NODE_CONTAINER: &str = "ferrovol-images-test-node";

impl Podman {
    fn new(dir: &Path) -> Result<Podman> {
        let conf = dir.join("containers.conf");
        let storage_conf = dir.join("storage.conf");
        let path = |p: &str| -> Result<String> {
            let full = dir.join(p);
            std::fs::create_dir_all(&full)?;
            Ok(full
                .to_str()
                .context("the target directory's path is not UTF-8")?
                .to_string())
        };
        // runc, since crun fails on this machine kind (cgroup v1 hybrid), and no default ulimits,
        // which runc cannot set here; no systemd either.
        std::fs::write(
            &conf,
            format!(
                "[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = \"runc\"\n\
                 cgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\ntmp_dir = {}\n",
                json_str(&path("tmp")?)
            ),
        )?;
        // vfs: plain directories, nothing mounted, works on any file system.
        std::fs::write(
            &storage_conf,
            format!(
                "[storage]\ndriver = \"vfs\"\ngraphroot = {}\nrunroot = {}\n",
                json_str(&path("storage")?),
                json_str(&path("run")?)
            ),
        )?;
        Ok(Podman { conf, storage_conf })
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", &self.conf)
            .env("CONTAINERS_STORAGE_CONF", &self.storage_conf);
        cmd
    }

    fn run(&self, args: &[&str]) -> Result<String> {
        capture(self.cmd().args(args), PODMAN_TIMEOUT)
    }

    fn exec(&self, container: &str, argv: &[&str]) -> Result<String> {
        let out = capture_all(
            self.cmd().args(["exec", container]).args(argv),
            PODMAN_TIMEOUT,
        )
        .with_context(|| format!("`{}` failed in {container}", argv.join(" ")))?;
        if let Some(first) = out.lines().find(|l| !l.trim().is_empty()) {
            println!("    {first}");
        }
        Ok(out)
    }

    /// Logs of a container, for error messages.
    fn logs(&self, container: &str) -> String {
        capture_all(self.cmd().args(["logs", container]), PODMAN_TIMEOUT).unwrap_or_default()
    }

    fn remove_all(&self) {
        if let Err(err) = util::run(
            self.cmd().args(["rm", "--force", "--all", "--time", "0"]),
            PODMAN_TIMEOUT,
        ) {
            eprintln!("warning: removing the test containers: {err:#}");
        }
        if let Err(err) = util::run(self.cmd().args(["rmi", "--force", "--all"]), PODMAN_TIMEOUT) {
            eprintln!("warning: removing the test images: {err:#}");
        }
    }
}

fn test_images(built: &[Built]) -> Result<()> {
    let started = Instant::now();
    tools::debian_packages()?;
    tools::image_test_packages()?;
    let dir = util::target_dir().join(TEST_DIR);
    let _lock = lock(&util::target_dir().join(format!("{TEST_DIR}.lock")))?;
    util::fresh_dir(&dir)?;
    let podman = Podman::new(&dir)?;
    let result = runtime_checks(&podman, built, &dir);
    podman.remove_all();
    detach_loops(&dir.join("work"));
    util::cleanup(&dir);
    if result.is_ok() {
        util::remove_dir(&dir)?;
    } else {
        println!("images: the test's files are kept in {}", dir.display());
    }
    result?;
    println!(
        "images: skopeo, podman and containerd checks passed in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn runtime_checks(podman: &Podman, built: &[Built], dir: &Path) -> Result<()> {
    let image = |name: &str| {
        built
            .iter()
            .find(|b| b.spec.name == name)
            .with_context(|| format!("{name} was not built"))
    };
    let controller = image("ferrovol-controller")?;
    let node = image("ferrovol-node")?;
    let probe = util::target_dir().join(PROFILE).join("ferrovol-probe");

    println!("\nimages: skopeo reads both archive formats");
    for b in built {
        let archive = b.archive.display().to_string();
        let oci = capture(
            Command::new("skopeo").args(["inspect", &format!("oci-archive:{archive}")]),
            PODMAN_TIMEOUT,
        )?;
        ensure!(
            oci.contains(&b.manifest_digest),
            "skopeo inspect oci-archive:{archive} does not show the manifest {}:\n{oci}",
            b.manifest_digest
        );
        let docker = capture(
            Command::new("skopeo").args(["inspect", &format!("docker-archive:{archive}")]),
            PODMAN_TIMEOUT,
        )?;
        for (_, digest, _) in &b.layers {
            ensure!(
                docker.contains(digest.as_str()),
                "skopeo inspect docker-archive:{archive} does not list the layer {digest}:\n{docker}"
            );
        }
    }

    println!("\nimages: podman load");
    for b in built {
        let out = capture_all(
            podman.cmd().args(["load", "--input"]).arg(&b.archive),
            LOAD_TIMEOUT,
        )?;
        let name = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("Loaded image: "))
            .or_else(|| {
                out.lines()
                    .find_map(|l| l.trim().strip_prefix("Loaded image(s): "))
            })
            .with_context(|| format!("podman load named no image:\n{out}"))?
            .trim()
            .to_string();
        let id = podman.run(&["image", "inspect", "--format", "{{.Id}}", &name])?;
        ensure!(
            b.config_digest.ends_with(id.trim()) && !id.trim().is_empty(),
            "podman loaded {name} with id {}, expected {}",
            id.trim(),
            b.config_digest
        );
        ensure!(
            name == b.reference,
            "podman loaded the image as {name}, not {}",
            b.reference
        );
        println!("  {name}: image id sha256:{}", id.trim());
    }

    // The controller: as nonroot, Probe over a socket in a directory shared with the host.
    println!(
        "\nimages: {} serves Probe as uid {NONROOT}",
        controller.reference
    );
    let csi = dir.join("controller-csi");
    std::fs::create_dir_all(&csi)?;
    std::os::unix::fs::chown(&csi, Some(NONROOT), Some(NONROOT))
        .with_context(|| format!("chown {}", csi.display()))?;
    podman.run(&[
        "run",
        "--runtime",
        "runc",
        "--detach",
        "--network",
        "none",
        "--name",
        CONTROLLER_CONTAINER,
        "--volume",
        &format!("{}:/csi:z", csi.display()),
        &controller.reference,
        "--endpoint",
        "unix:///csi/csi.sock",
        "--node-id",
        "t",
        "--state-dir",
        "/tmp/state",
    ])?;
    let socket = csi.join("csi.sock");
    probe_socket(&probe, &socket)
        .with_context(|| format!("logs:\n{}", podman.logs(CONTROLLER_CONTAINER)))?;
    let owner = socket.metadata()?.uid();
    ensure!(
        owner == NONROOT,
        "the controller's socket belongs to uid {owner}, so the image did not run as {NONROOT}"
    );
    util::run(
        podman
            .cmd()
            .args(["stop", "--time", "10", CONTROLLER_CONTAINER]),
        PODMAN_TIMEOUT,
    )?;

    // The node plugin, privileged as in its DaemonSet; every tool runs inside it.
    println!(
        "\nimages: {} serves Probe, and its tools work",
        node.reference
    );
    let csi = dir.join("node-csi");
    let work = dir.join("work");
    std::fs::create_dir_all(&csi)?;
    std::fs::create_dir_all(work.join("mnt"))?;
    // `mount -o loop` in the container needs a free loop device that exists when it starts:
    // a privileged container sees the host's /dev as it was then.
    util::run(Command::new("losetup").arg("--find"), QUICK_TIMEOUT)?;
    podman.run(&[
        "run",
        "--runtime",
        "runc",
        "--detach",
        "--privileged",
        "--network",
        "none",
        "--name",
        NODE_CONTAINER,
        "--volume",
        &format!("{}:/csi:z", csi.display()),
        "--volume",
        &format!("{}:/work:z", work.display()),
        &node.reference,
        "--endpoint",
        "unix:///csi/csi.sock",
        "--node-id",
        "t",
        "--state-dir",
        "/tmp/state",
        "--kubelet-dir",
        "/tmp/kubelet",
    ])?;
    probe_socket(&probe, &csi.join("csi.sock"))
        .with_context(|| format!("logs:\n{}", podman.logs(NODE_CONTAINER)))?;
    node_tool_checks(podman, &work)
        .with_context(|| format!("node plugin logs:\n{}", podman.logs(NODE_CONTAINER)))?;
    util::run(
        podman.cmd().args(["stop", "--time", "10", NODE_CONTAINER]),
        PODMAN_TIMEOUT,
    )?;

    containerd_checks(built, &dir.join("containerd"))
}

/// A throwaway containerd, as on a Kubernetes node: `ctr -n k8s.io images import` must take each
/// archive under the name kubelet looks for, with our manifest digest, and run it.
fn containerd_checks(built: &[Built], dir: &Path) -> Result<()> {
    use std::os::unix::process::CommandExt;
    println!("\nimages: containerd imports and runs both archives");
    std::fs::create_dir_all(dir)?;
    let socket = dir.join("containerd.sock");
    let config = dir.join("config.toml");
    let toml_path = |p: PathBuf| -> Result<String> {
        Ok(json_str(
            p.to_str()
                .context("the target directory's path is not UTF-8")?,
        ))
    };
    // No CRI plugin: nothing here talks to kubelet, and it would look for CNI.
    std::fs::write(
        &config,
        format!(
            "version = 2\nroot = {}\nstate = {}\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\n\
             [grpc]\naddress = {}\n",
            toml_path(dir.join("root"))?,
            toml_path(dir.join("state"))?,
            toml_path(socket.clone())?,
        ),
    )?;
    let log_path = dir.join("containerd.log");
    let log = File::create(&log_path)?;
    let mut daemon = Command::new("containerd")
        .arg("--config")
        .arg(&config)
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("cannot start containerd")?;
    let ctr = || {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&socket)
            .args(["--namespace", "k8s.io"]);
        cmd
    };
    let result = (|| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while capture(ctr().arg("version"), QUICK_TIMEOUT).is_err() {
            ensure!(
                Instant::now() < deadline,
                "containerd did not start within 30 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        for b in built {
            // The native snapshotter copies files: no overlay mounts, any file system.
            util::run(
                ctr()
                    .args(["images", "import", "--snapshotter", "native"])
                    .arg(&b.archive),
                LOAD_TIMEOUT,
            )?;
        }
        let images = capture(ctr().args(["images", "list"]), QUICK_TIMEOUT)?;
        for b in built {
            let name = &b.reference;
            ensure!(
                images
                    .lines()
                    .any(|l| l.starts_with(&format!("{name} ")) && l.contains(&b.manifest_digest)),
                "containerd does not list {name} with manifest {}:\n{images}",
                b.manifest_digest
            );
        }
        for b in built {
            let out = capture_all(
                ctr()
                    .args(["run", "--rm", "--snapshotter", "native", &b.reference])
                    .arg(format!("ferrovol-images-test-{}", std::process::id()))
                    .arg(b.spec.entrypoint)
                    .arg("--version"),
                PODMAN_TIMEOUT,
            )?;
            println!("    {}", out.trim());
        }
        Ok(())
    })();
    // Stop the daemon this function started, gracefully, then for sure.
    let _ = util::signal(&[daemon.id().to_string()], "TERM");
    if !matches!(
        util::wait_timeout(&mut daemon, Duration::from_secs(10)),
        Ok(Some(_))
    ) {
        eprintln!("warning: containerd did not stop on SIGTERM: killed");
    }
    result.with_context(|| format!("containerd's log ends with:\n{}", util::tail(&log_path, 20)))
}

fn probe_socket(probe: &Path, socket: &Path) -> Result<()> {
    util::run(
        Command::new(probe)
            .arg(socket)
            .args(["--wait", PROBE_WAIT_SECS]),
        PROBE_TIMEOUT,
    )
}

/// Every tool of the node image, run in the node container: versions first, then the real work
/// on files of a shared directory (`work` on the host, /work inside).
fn node_tool_checks(podman: &Podman, work: &Path) -> Result<()> {
    let c = NODE_CONTAINER;
    for argv in [
        &["csi-node", "--version"][..],
        &["csi-controller", "--version"],
        &["mkfs.ext4", "-V"],
        &["e2fsck", "-V"],
        &["mkfs.xfs", "-V"],
        &["xfs_growfs", "-V"],
        &["blkid", "-V"],
        &["mount", "-V"],
        &["umount", "-V"],
        &["losetup", "-V"],
    ] {
        podman.exec(c, argv)?;
    }
    let node_help = podman.exec(c, &["csi-node", "--help"])?;
    ensure!(
        node_help.contains("--kubelet-dir"),
        "csi-node --help does not document --kubelet-dir:\n{node_help}"
    );

    // ext4: format, probe, check, grow offline as NodeStage does.
    let ext4 = work.join("ext4.img");
    File::create(&ext4)?.set_len(16 * MIB)?;
    podman.exec(c, &["mkfs.ext4", "-q", "-F", "/work/ext4.img"])?;
    let fs = podman.exec(
        c,
        &["blkid", "-p", "-o", "value", "-s", "TYPE", "/work/ext4.img"],
    )?;
    ensure!(fs.trim() == "ext4", "blkid saw `{}`, not ext4", fs.trim());
    File::options().write(true).open(&ext4)?.set_len(32 * MIB)?;
    podman.exec(c, &["e2fsck", "-f", "-p", "/work/ext4.img"])?;
    podman.exec(c, &["resize2fs", "/work/ext4.img"])?;
    podman.exec(c, &["e2fsck", "-f", "-n", "/work/ext4.img"])?;
    let size = ext4_size(&ext4)?;
    ensure!(
        size == 32 * MIB,
        "after resize2fs the ext4 file system has {size} bytes, not 32 MiB"
    );

    // xfs: format, probe, loop-mount, grow online, unmount.
    let xfs = work.join("xfs.img");
    File::create(&xfs)?.set_len(300 * MIB)?;
    podman.exec(c, &["mkfs.xfs", "-q", "-K", "/work/xfs.img"])?;
    let fs = podman.exec(
        c,
        &["blkid", "-p", "-o", "value", "-s", "TYPE", "/work/xfs.img"],
    )?;
    ensure!(fs.trim() == "xfs", "blkid saw `{}`, not xfs", fs.trim());
    File::options().write(true).open(&xfs)?.set_len(400 * MIB)?;
    podman.exec(c, &["mount", "-o", "loop", "/work/xfs.img", "/work/mnt"])?;
    let grown = (|| {
        let loops = podman.exec(c, &["losetup", "-j", "/work/xfs.img"])?;
        ensure!(
            loops.contains("/dev/loop"),
            "losetup -j shows no loop device for the mounted image:\n{loops}"
        );
        podman.exec(c, &["xfs_growfs", "-d", "/work/mnt"]).map(drop)
    })();
    let unmounted = podman.exec(c, &["umount", "/work/mnt"]);
    grown?;
    unmounted?;
    let size = xfs_size(&xfs)?;
    ensure!(
        size == 400 * MIB,
        "after xfs_growfs the xfs file system has {size} bytes, not 400 MiB"
    );
    Ok(())
}

/// Bytes of the ext4 file system in `image`, from its superblock.
fn ext4_size(image: &Path) -> Result<u64> {
    let data = read_prefix(image, 2048)?;
    let sb = &data[1024..];
    let le32 = |at: usize| {
        u64::from(u32::from_le_bytes([
            sb[at],
            sb[at + 1],
            sb[at + 2],
            sb[at + 3],
        ]))
    };
    ensure!(
        sb[0x38..0x3a] == [0x53, 0xef],
        "{} holds no ext4 superblock",
        image.display()
    );
    Ok(le32(0x04) * (1024 << le32(0x18)))
}

/// Bytes of the xfs data section in `image`, from its superblock.
fn xfs_size(image: &Path) -> Result<u64> {
    let data = read_prefix(image, 16)?;
    ensure!(
        data.starts_with(b"XFSB"),
        "{} holds no xfs superblock",
        image.display()
    );
    let blocksize = u64::from(u32::from_be_bytes([data[4], data[5], data[6], data[7]]));
    let mut dblocks = [0u8; 8];
    dblocks.copy_from_slice(&data[8..16]);
    Ok(u64::from_be_bytes(dblocks) * blocksize)
}

fn read_prefix(path: &Path, len: usize) -> Result<Vec<u8>> {
    use std::io::Read as _;
    let mut data = vec![0; len];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut data))
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(data)
}

/// Detaches the loop devices backed by a file below `dir`, matched by `losetup -j` (device and
/// inode): a loop device made in a container shows the container's path, not the host's.
fn detach_loops(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        let Ok(out) = capture(Command::new("losetup").arg("-j").arg(&path), QUICK_TIMEOUT) else {
            continue;
        };
        for dev in out.lines().filter_map(|l| l.split(':').next()) {
            eprintln!(
                "warning: {dev} still backs {}: detaching it",
                path.display()
            );
            let _ = util::run(Command::new("losetup").args(["-d", dev]), QUICK_TIMEOUT);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Takes an exclusive flock on `path` (released when the file is dropped), failing at once if
/// another xtask holds it.
fn lock(path: &Path) -> Result<File> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            bail!("another `cargo xtask images` holds {}", path.display())
        }
        Err(std::fs::TryLockError::Error(err)) => {
            Err(err).with_context(|| format!("cannot lock {}", path.display()))
        }
    }
}

/// [`util::run`], returning the standard output (standard error still goes to the terminal).
fn capture(cmd: &mut Command, timeout: Duration) -> Result<String> {
    run_captured(cmd, timeout, false)
}

/// [`util::run`], returning standard output and standard error together.
fn capture_all(cmd: &mut Command, timeout: Duration) -> Result<String> {
    run_captured(cmd, timeout, true)
}

fn run_captured(cmd: &mut Command, timeout: Duration, stderr: bool) -> Result<String> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    // A file rather than a pipe: a daemon the command leaves behind may hold its output open.
    let path = std::env::temp_dir().join(format!(
        "ferrovol-xtask-{}-{}.out",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
    if stderr {
        cmd.stderr(file.try_clone()?);
    }
    cmd.stdout(file);
    let result = util::run(cmd, timeout);
    let out = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(()) => Ok(out),
        Err(err) if out.trim().is_empty() => Err(err),
        Err(err) => Err(err).with_context(|| format!("its output:\n{}", out.trim_end())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
    }

    #[test]
    fn ustar_headers_are_valid() {
        let h = ustar_header("usr/bin/x", b'0', 0o755, 0, 5, 0, "").expect("header");
        assert_eq!(&h[..9], b"usr/bin/x");
        assert_eq!(&h[100..108], b"0000755\0");
        assert_eq!(&h[124..136], b"00000000005\0");
        assert_eq!(&h[257..265], b"ustar\x0000");
        let stored = std::str::from_utf8(&h[148..154]).expect("ascii");
        let mut blank = h;
        blank[148..156].fill(b' ');
        let sum: u32 = blank.iter().map(|&b| u32::from(b)).sum();
        assert_eq!(u32::from_str_radix(stored, 8).expect("octal"), sum);

        let long = format!("{}/{}", "d".repeat(120), "f".repeat(90));
        let (prefix, name) = split_name(&long).expect("split");
        assert_eq!((prefix.len(), name.len()), (120, 90));
        assert!(split_name(&"x".repeat(101)).is_err());
    }

    #[test]
    fn tar_streams_are_padded_and_terminated() {
        let mut tar = TarWriter::new(Vec::new(), 0);
        tar.dir("etc/", 0o755, 0).expect("dir");
        tar.file("etc/a", 0o644, b"hello").expect("file");
        tar.symlink("etc/b", "a").expect("symlink");
        let bytes = tar.finish().expect("finish");
        assert_eq!(bytes.len(), 512 * 4 + 1024);
        assert_eq!(&bytes[1024..1029], b"hello");
        assert_eq!(bytes[512 * 3 + 156], b'2');
        assert_eq!(&bytes[512 * 3 + 157..512 * 3 + 158], b"a");
    }

    #[test]
    fn elf_of_this_test_binary() {
        let exe = std::fs::read("/proc/self/exe").expect("read own executable");
        let elf = Elf::parse(&exe).expect("parse");
        let interp = elf.interp.expect("a dynamic executable has PT_INTERP");
        assert!(interp.contains("ld-linux"), "{interp}");
        assert!(
            elf.needed.iter().any(|n| n == "libc.so.6"),
            "{:?}",
            elf.needed
        );
        assert!(Elf::parse(b"#!/bin/sh\n").is_err());
    }

    #[test]
    fn paths_normalize() {
        assert_eq!(
            normalize("/lib64", "/lib/x86_64-linux-gnu/ld.so").expect("abs"),
            "/lib/x86_64-linux-gnu/ld.so"
        );
        assert_eq!(normalize("/sbin", "mke2fs").expect("rel"), "/sbin/mke2fs");
        assert_eq!(
            normalize("/usr/lib/x", "../../lib/./y").expect("dots"),
            "/usr/lib/y"
        );
        assert!(normalize("/", "..").is_err());
        assert_eq!(parent("/sbin/mke2fs"), "/sbin");
        assert_eq!(parent("/tmp"), "/");
    }

    #[test]
    fn layers_list_parents_first_and_sorted() {
        let mut tree = Tree::default();
        tree.insert(
            "/usr/bin/b",
            Entry::File {
                source: Source::Bytes(b"b".to_vec()),
                mode: 0o755,
            },
            None,
        )
        .expect("insert");
        tree.insert("/usr/bin/a", Entry::Symlink("b".into()), None)
            .expect("insert");
        tree.insert(
            "/tmp",
            Entry::Dir {
                mode: 0o1777,
                uid: 0,
            },
            None,
        )
        .expect("insert");
        assert!(
            tree.insert("/usr/bin/a", Entry::Symlink("c".into()), None)
                .is_err()
        );
        let layer = tree.layer(0).expect("layer");
        let names: Vec<String> = layer
            .chunks(512)
            .filter(|block| &block[257..262] == b"ustar")
            .map(|block| {
                let end = block[..100].iter().position(|&b| b == 0).unwrap_or(100);
                String::from_utf8_lossy(&block[..end]).into_owned()
            })
            .collect();
        assert_eq!(
            names,
            ["tmp/", "usr/", "usr/bin/", "usr/bin/a", "usr/bin/b"]
        );
        assert_eq!(tree.layer(0).expect("again"), layer);
    }

    #[test]
    fn deb_file_names() {
        let file = Deb::file_name("libdevmapper1.02.1", "2:1.02.185-2", "amd64");
        assert_eq!(file, "libdevmapper1.02.1_2%3a1.02.185-2_amd64.deb");
        assert_eq!(
            Deb::parse_file_name(&file),
            Some((
                "libdevmapper1.02.1".into(),
                "2:1.02.185-2".into(),
                "amd64".into()
            ))
        );
        assert_eq!(Deb::parse_file_name("x.deb"), None);
    }

    #[test]
    fn json_and_cargo_fields() {
        assert_eq!(json_str("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\u0001""#);
        let toml = "[workspace]\nversion = \"9\"\n[workspace.package]\nversion = \"0.1.0\"\n\
                    repository = \"https://example.org/x\"\n[other]\nlicense = \"no\"\n";
        assert_eq!(
            workspace_package_field(toml, "repository").as_deref(),
            Some("https://example.org/x")
        );
        assert_eq!(workspace_package_field(toml, "license"), None);
    }
}
