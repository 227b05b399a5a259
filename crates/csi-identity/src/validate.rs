//! Argument checks shared by the Controller and Node services. Each returns INVALID_ARGUMENT
//! with a message a person can act on.

use crate::status::invalid;
use csi_proto::v1::volume_capability::{AccessType, access_mode::Mode};
use csi_proto::v1::{VolumeCapability, volume_capability::MountVolume};
use tonic::Status;

/// Filesystems the node plugin will create. Anything else is refused before any `mkfs.*` runs.
pub const FS_TYPES: &[&str] = &["ext4", "xfs"];
pub const DEFAULT_FS_TYPE: &str = "ext4";
/// Longest CSI name we accept (Kubernetes object names are at most 253 bytes).
pub const MAX_NAME_LEN: usize = 253;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Mount {
        fs_type: String,
        mount_flags: Vec<String>,
    },
    Block,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    pub access: Access,
    pub mode: Mode,
}

impl Capability {
    pub fn read_only_mode(&self) -> bool {
        matches!(
            self.mode,
            Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly
        )
    }
}

pub fn require(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(invalid(format!("{field} is required")));
    }
    Ok(())
}

pub fn name(value: &str) -> Result<(), Status> {
    require("name", value)?;
    if value.len() > MAX_NAME_LEN {
        return Err(invalid(format!(
            "name is {} bytes long; at most {MAX_NAME_LEN} are accepted",
            value.len()
        )));
    }
    Ok(())
}

/// Checks one volume capability. `multi_node`: whether the backend can serve a volume to
/// several nodes at once.
pub fn capability(cap: &VolumeCapability, multi_node: bool) -> Result<Capability, Status> {
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| Mode::try_from(m.mode).unwrap_or(Mode::Unknown))
        .ok_or_else(|| invalid("volume_capability.access_mode is required"))?;
    match mode {
        Mode::Unknown => {
            return Err(invalid(
                "volume_capability.access_mode is UNKNOWN or unrecognised",
            ));
        }
        Mode::MultiNodeReaderOnly | Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter
            if !multi_node =>
        {
            return Err(invalid(format!(
                "access mode {} is not supported: volumes of this backend attach to one node at a time \
                 (use SINGLE_NODE_WRITER, SINGLE_NODE_SINGLE_WRITER, SINGLE_NODE_MULTI_WRITER or SINGLE_NODE_READER_ONLY)",
                mode.as_str_name()
            )));
        }
        _ => {}
    }
    let access = match &cap.access_type {
        Some(AccessType::Block(_)) => Access::Block,
        Some(AccessType::Mount(m)) => mount(m)?,
        None => {
            return Err(invalid(
                "volume_capability.access_type is required (mount or block)",
            ));
        }
    };
    Ok(Capability { access, mode })
}

pub fn capabilities(
    caps: &[VolumeCapability],
    multi_node: bool,
) -> Result<Vec<Capability>, Status> {
    if caps.is_empty() {
        return Err(invalid("volume_capabilities is required"));
    }
    caps.iter().map(|c| capability(c, multi_node)).collect()
}

fn mount(m: &MountVolume) -> Result<Access, Status> {
    let fs_type = if m.fs_type.is_empty() {
        DEFAULT_FS_TYPE.to_string()
    } else {
        m.fs_type.clone()
    };
    if !FS_TYPES.contains(&fs_type.as_str()) {
        return Err(invalid(format!(
            "fs_type {:?} is not supported; choose one of {FS_TYPES:?}",
            m.fs_type
        )));
    }
    if !m.volume_mount_group.is_empty() {
        return Err(invalid(
            "volume_mount_group is not supported (ext4 and xfs have no gid mount option); kubelet applies fsGroup itself",
        ));
    }
    for flag in &m.mount_flags {
        mount_flag(flag)?;
    }
    Ok(Access::Mount {
        fs_type,
        mount_flags: m.mount_flags.clone(),
    })
}

/// Flags that would change what is mounted rather than how (binds, moves, remounts) or that
/// could smuggle several options into one, are refused.
pub fn mount_flag(flag: &str) -> Result<(), Status> {
    const FORBIDDEN: &[&str] = &[
        "bind",
        "rbind",
        "move",
        "remount",
        "make-shared",
        "make-private",
        "make-slave",
        "make-rshared",
        "make-rprivate",
        "make-rslave",
        "make-unbindable",
    ];
    let ok_chars = flag
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "=_-.:/".contains(c));
    if flag.is_empty() || !ok_chars || FORBIDDEN.contains(&flag) {
        return Err(invalid(format!("mount flag {flag:?} is not allowed")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi_proto::v1::volume_capability::{AccessMode, BlockVolume};

    fn cap(mode: Mode, access: AccessType) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(access),
        }
    }

    fn mount_cap(fs: &str, flags: &[&str]) -> VolumeCapability {
        cap(
            Mode::SingleNodeWriter,
            AccessType::Mount(MountVolume {
                fs_type: fs.into(),
                mount_flags: flags.iter().map(|s| s.to_string()).collect(),
                volume_mount_group: String::new(),
            }),
        )
    }

    #[test]
    fn defaults_and_allow_list() {
        let c = capability(&mount_cap("", &[]), false).unwrap();
        assert_eq!(
            c.access,
            Access::Mount {
                fs_type: "ext4".into(),
                mount_flags: vec![]
            }
        );
        assert!(capability(&mount_cap("xfs", &["noatime"]), false).is_ok());
        for bad in ["btrfs", "ext4; rm -rf /", "vfat", "../xfs"] {
            let err = capability(&mount_cap(bad, &[]), false).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn hostile_mount_flags_are_refused() {
        for bad in ["bind", "remount", "ro,bind", "x y", ""] {
            assert!(
                capability(&mount_cap("ext4", &[bad]), false).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn multi_node_modes_need_backend_support() {
        let c = cap(
            Mode::MultiNodeMultiWriter,
            AccessType::Block(BlockVolume {}),
        );
        assert!(capability(&c, false).is_err());
        assert!(capability(&c, true).is_ok());
        let unknown = VolumeCapability {
            access_mode: None,
            access_type: Some(AccessType::Block(BlockVolume {})),
        };
        assert!(capability(&unknown, true).is_err());
    }
}
