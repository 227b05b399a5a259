//! What the node holds, seen from the host: the one-node cluster runs on this machine, so its
//! loop devices, mounts and state directory are this machine's.

use anyhow::{Context, Result, bail};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoopDevice {
    pub name: String,
    pub backing_file: String,
}

/// Every attached loop device with its backing file (from sysfs, as `losetup -a` reads it).
pub fn loop_devices() -> Vec<LoopDevice> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut devices: Vec<LoopDevice> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("loop"))
        .filter_map(|name| {
            let backing =
                std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
            Some(LoopDevice {
                name: format!("/dev/{name}"),
                backing_file: backing.trim_end().to_string(),
            })
        })
        .collect();
    devices.sort_by(|a, b| a.name.cmp(&b.name));
    devices
}

/// The mount points in the host's mount namespace and, when kubelet runs in another one, in
/// kubelet's: that is where CSI staging and publish mounts are made.
pub fn mount_points() -> Vec<PathBuf> {
    let mut tables = vec![PathBuf::from("/proc/self/mountinfo")];
    if let Some(pid) = pid_of("kubelet") {
        let own = std::fs::read_link("/proc/self/ns/mnt").ok();
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
        if theirs.is_some() && theirs != own {
            tables.push(PathBuf::from(format!("/proc/{pid}/mountinfo")));
        }
    }
    let mut points = Vec::new();
    for table in tables {
        let Ok(text) = std::fs::read_to_string(&table) else {
            continue;
        };
        points.extend(
            text.lines()
                .filter_map(|l| l.split(' ').nth(4))
                .map(|p| PathBuf::from(decode_octal(p))),
        );
    }
    points.sort();
    points.dedup();
    points
}

fn pid_of(comm: &str) -> Option<String> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|pid| pid.chars().all(|c| c.is_ascii_digit()))
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm)
        })
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn decode_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(v as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The entries of `dir` (none if it does not exist).
pub fn entries(dir: &Path) -> Result<Vec<String>> {
    match std::fs::read_dir(dir) {
        Ok(rd) => {
            let mut names: Vec<String> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            Ok(names)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", dir.display())),
    }
}

/// One EC2 query-API call to moto (`Action=…&Version=…` plus `params`), returning the XML.
/// moto routes a request by the service in the credential scope and does not check signatures,
/// so no SDK is needed to ask it what exists.
pub fn ec2_query(endpoint: &str, action: &str, params: &[(&str, &str)]) -> Result<String> {
    let hostport = endpoint
        .strip_prefix("http://")
        .context("moto's endpoint must be http://host:port")?
        .trim_end_matches('/');
    let mut query = format!("Action={action}&Version=2016-11-15");
    for (k, v) in params {
        query.push('&');
        query.push_str(k);
        query.push('=');
        query.push_str(&v.replace('/', "%2F"));
    }
    let mut stream = std::net::TcpStream::connect(hostport)
        .with_context(|| format!("connecting to moto at {hostport}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        stream,
        "GET /?{query} HTTP/1.0\r\nHost: {hostport}\r\nAuthorization: AWS4-HMAC-SHA256 \
         Credential=testing/20260101/us-east-1/ec2/aws4_request, SignedHeaders=host, \
         Signature=0\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("moto sent no HTTP response")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!(
            "{action}: moto answered {}: {body}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(body.to_string())
}

/// The distinct values of `<tag>…</tag>` in `xml`.
pub fn xml_values(xml: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut values = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        rest = &rest[start + open.len()..];
        let Some(end) = rest.find(&close) else { break };
        values.push(rest[..end].to_string());
        rest = &rest[end..];
    }
    values.sort();
    values.dedup();
    values
}
