//! StorageClass (and VolumeAttributesClass) parameters of the aws backend, validated before any
//! EC2 call, with the per-type limits of EBS.

use crate::error::{Error, Result};
use std::collections::BTreeMap;

pub const GIB: u64 = 1 << 30;

/// Keys the aws backend understands in `parameters` (plus `tagSpecification_N`, and the
/// `csi.storage.k8s.io/` keys external-provisioner adds).
pub const KEYS: &[&str] = &[
    "type",
    "iops",
    "iopsPerGB",
    "allowAutoIOPSPerGBIncrease",
    "throughput",
    "encrypted",
    "kmsKeyId",
];
/// Keys accepted as mutable parameters (ControllerModifyVolume / VolumeAttributesClass).
pub const MUTABLE_KEYS: &[&str] = &["type", "iops", "throughput"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TypeLimits {
    pub name: &'static str,
    pub min_gib: u64,
    pub max_gib: u64,
    /// (min, max, max per GiB); None when the type has no provisioned IOPS.
    pub iops: Option<(u64, u64, u64)>,
    /// (min, max) MiB/s when throughput is provisioned.
    pub throughput: Option<(u64, u64)>,
}

pub const TYPES: &[TypeLimits] = &[
    TypeLimits {
        name: "gp3",
        min_gib: 1,
        max_gib: 65536,
        iops: Some((3000, 80000, 500)),
        throughput: Some((125, 2000)),
    },
    TypeLimits {
        name: "gp2",
        min_gib: 1,
        max_gib: 16384,
        iops: None,
        throughput: None,
    },
    TypeLimits {
        name: "io1",
        min_gib: 4,
        max_gib: 16384,
        iops: Some((100, 64000, 50)),
        throughput: None,
    },
    TypeLimits {
        name: "io2",
        min_gib: 4,
        max_gib: 65536,
        iops: Some((100, 256000, 1000)),
        throughput: None,
    },
    TypeLimits {
        name: "st1",
        min_gib: 125,
        max_gib: 16384,
        iops: None,
        throughput: None,
    },
    TypeLimits {
        name: "sc1",
        min_gib: 125,
        max_gib: 16384,
        iops: None,
        throughput: None,
    },
    TypeLimits {
        name: "standard",
        min_gib: 1,
        max_gib: 1024,
        iops: None,
        throughput: None,
    },
];

pub const DEFAULT_TYPE: &str = "gp3";

pub fn limits(volume_type: &str) -> Result<&'static TypeLimits> {
    TYPES.iter().find(|t| t.name == volume_type).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "type {volume_type:?} is not an EBS volume type; choose one of {}",
            TYPES.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// Everything CreateVolume needs from the parameters, checked.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VolumeParams {
    pub volume_type: String,
    pub iops: Option<u64>,
    pub iops_per_gb: Option<u64>,
    pub allow_iops_increase: bool,
    pub throughput: Option<u64>,
    pub encrypted: bool,
    pub kms_key_id: Option<String>,
    /// Extra tags from `tagSpecification_N: "key=value"`, templated.
    pub tags: BTreeMap<String, String>,
}

fn number(key: &str, value: &str) -> Result<u64> {
    value.trim().parse::<u64>().map_err(|_| {
        Error::InvalidArgument(format!(
            "parameter {key}={value:?} must be a whole positive number"
        ))
    })
}

fn boolean(key: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(Error::InvalidArgument(format!(
            "parameter {key}={value:?} must be true or false"
        ))),
    }
}

/// `{{ .PVCName }}`, `{{ .PVCNamespace }}` and `{{ .PVName }}` in tag values are replaced
/// from the metadata external-provisioner passes with `--extra-create-metadata`.
pub fn template(value: &str, metadata: &BTreeMap<String, String>) -> Result<String> {
    let vars = [
        ("PVCName", "csi.storage.k8s.io/pvc/name"),
        ("PVCNamespace", "csi.storage.k8s.io/pvc/namespace"),
        ("PVName", "csi.storage.k8s.io/pv/name"),
    ];
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("}}").ok_or_else(|| {
            Error::InvalidArgument(format!("unterminated {{{{ in tag value {value:?}"))
        })?;
        let name = rest[start + 2..start + end].trim().trim_start_matches('.');
        let (_, key) = vars
            .iter()
            .find(|(v, _)| *v == name)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown template variable {name:?} in tag value {value:?}; use .PVCName, .PVCNamespace or .PVName")))?;
        out.push_str(metadata.get(*key).map(String::as_str).unwrap_or(""));
        rest = &rest[start + end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

pub fn parse(parameters: &BTreeMap<String, String>) -> Result<VolumeParams> {
    let mut p = VolumeParams {
        volume_type: DEFAULT_TYPE.into(),
        ..Default::default()
    };
    let mut unknown = Vec::new();
    for (key, value) in parameters {
        match key.as_str() {
            "type" => p.volume_type = value.trim().to_ascii_lowercase(),
            "iops" => p.iops = Some(number(key, value)?),
            "iopsPerGB" => p.iops_per_gb = Some(number(key, value)?),
            "allowAutoIOPSPerGBIncrease" => p.allow_iops_increase = boolean(key, value)?,
            "throughput" => p.throughput = Some(number(key, value)?),
            "encrypted" => p.encrypted = boolean(key, value)?,
            "kmsKeyId" => p.kms_key_id = Some(value.clone()),
            k if k.starts_with("tagSpecification_") => {
                let (tk, tv) = value.split_once('=').ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "parameter {key}={value:?} must have the form key=value"
                    ))
                })?;
                let tk = tk.trim();
                if tk.is_empty() || tk.starts_with("aws:") {
                    return Err(Error::InvalidArgument(format!(
                        "parameter {key}: tag key {tk:?} is empty or reserved"
                    )));
                }
                p.tags
                    .insert(tk.to_string(), template(tv.trim(), parameters)?);
            }
            k if k.starts_with(crate::local::RESERVED_PARAMETER_PREFIX) => {}
            k => unknown.push(k.to_string()),
        }
    }
    if !unknown.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "unknown parameter(s) {unknown:?}; the aws backend accepts: {}, tagSpecification_N (keys under csi.storage.k8s.io/ are accepted and ignored)",
            KEYS.join(", ")
        )));
    }
    let l = limits(&p.volume_type)?;
    if p.iops.is_some() && p.iops_per_gb.is_some() {
        return Err(Error::InvalidArgument(
            "give either iops or iopsPerGB, not both".into(),
        ));
    }
    if (p.iops.is_some() || p.iops_per_gb.is_some()) && l.iops.is_none() {
        return Err(Error::InvalidArgument(format!(
            "type {} has no provisioned IOPS; iops/iopsPerGB apply to gp3, io1 and io2",
            l.name
        )));
    }
    if p.throughput.is_some() && l.throughput.is_none() {
        return Err(Error::InvalidArgument(format!(
            "type {} has no provisioned throughput; throughput applies to gp3",
            l.name
        )));
    }
    if p.kms_key_id.is_some() && !p.encrypted {
        return Err(Error::InvalidArgument(
            "kmsKeyId needs encrypted=true".into(),
        ));
    }
    Ok(p)
}

/// The size in GiB for a CSI capacity range on this type: whole GiB, at least the type's
/// minimum, never above `limit_bytes`.
pub fn size_gib(required: u64, limit: u64, l: &TypeLimits) -> Result<u64> {
    if limit > 0 && required > limit {
        return Err(Error::InvalidArgument(format!(
            "capacity range is impossible: required_bytes {required} exceeds limit_bytes {limit}"
        )));
    }
    let wanted = if required == 0 {
        l.min_gib.max(1) * GIB
    } else {
        required
    };
    let gib = wanted.div_ceil(GIB).max(l.min_gib);
    if gib > l.max_gib {
        return Err(Error::OutOfRange(format!(
            "{} volumes hold at most {} GiB; {gib} GiB was requested",
            l.name, l.max_gib
        )));
    }
    if limit > 0 && gib * GIB > limit {
        return Err(Error::OutOfRange(format!(
            "no {} volume fits limit_bytes {limit}: sizes are whole GiB and at least {} GiB",
            l.name, l.min_gib
        )));
    }
    Ok(gib)
}

/// The IOPS to provision for a volume of `gib`: explicit, or iopsPerGB × size capped at the
/// type's maximum (the common wish "as fast as this size allows"), raised to the minimum only
/// when allowAutoIOPSPerGBIncrease says so.
pub fn iops(p: &VolumeParams, gib: u64) -> Result<Option<u64>> {
    let l = limits(&p.volume_type)?;
    let Some((min, max, per_gib)) = l.iops else {
        return Ok(None);
    };
    // The per-GiB ratio limits IOPS above the type's baseline (gp3 gives 3000 at any size).
    let ceiling = max.min(min.max(per_gib * gib));
    match (p.iops, p.iops_per_gb) {
        (Some(i), _) => {
            if i < min || i > ceiling {
                return Err(Error::InvalidArgument(format!(
                    "iops={i} is outside what a {gib} GiB {} volume allows ({min}..={ceiling})",
                    l.name
                )));
            }
            Ok(Some(i))
        }
        (None, Some(per)) => {
            let want = (per * gib).min(ceiling);
            if want < min {
                if p.allow_iops_increase {
                    return Ok(Some(min.min(ceiling)));
                }
                return Err(Error::InvalidArgument(format!(
                    "iopsPerGB={per} × {gib} GiB = {want} IOPS is below the {} minimum of {min}; set allowAutoIOPSPerGBIncrease=true or ask for more",
                    l.name
                )));
            }
            Ok(Some(want))
        }
        (None, None) if l.name == "gp3" => Ok(None), // gp3's baseline 3000
        (None, None) => Err(Error::InvalidArgument(format!(
            "type {} needs iops or iopsPerGB",
            l.name
        ))),
    }
}

pub fn throughput(p: &VolumeParams) -> Result<Option<u64>> {
    let l = limits(&p.volume_type)?;
    match (p.throughput, l.throughput) {
        (Some(t), Some((min, max))) if t < min || t > max => Err(Error::InvalidArgument(format!(
            "throughput={t} MiB/s is outside {min}..={max} for {}",
            l.name
        ))),
        (t, _) => Ok(t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn defaults_to_gp3_and_names_unknown_keys() {
        assert_eq!(parse(&BTreeMap::new()).unwrap().volume_type, "gp3");
        let err = parse(&params(&[("iopsPerGb", "10")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("iopsPerGb") && err.contains("iopsPerGB"),
            "{err}"
        );
        assert!(
            parse(&params(&[("type", "gp4")]))
                .unwrap_err()
                .to_string()
                .contains("gp4")
        );
        assert!(parse(&params(&[("type", "gp2"), ("iops", "3000")])).is_err());
        assert!(parse(&params(&[("kmsKeyId", "k")])).is_err());
    }

    #[test]
    fn sizes_round_to_gib_within_type_limits() {
        let gp3 = limits("gp3").unwrap();
        assert_eq!(size_gib(1, 0, gp3).unwrap(), 1);
        assert_eq!(size_gib(GIB + 1, 0, gp3).unwrap(), 2);
        assert_eq!(size_gib(0, 0, limits("st1").unwrap()).unwrap(), 125);
        assert!(matches!(
            size_gib(GIB, GIB / 2 * 3, limits("io1").unwrap()),
            Err(Error::OutOfRange(_))
        ));
        assert!(matches!(
            size_gib(2000 * GIB, 0, limits("standard").unwrap()),
            Err(Error::OutOfRange(_))
        ));
        assert!(matches!(
            size_gib(2 * GIB, GIB, gp3),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn iops_are_capped_and_checked() {
        let io2 = parse(&params(&[("type", "io2"), ("iopsPerGB", "2000")])).unwrap();
        assert_eq!(
            iops(&io2, 10).unwrap(),
            Some(10_000),
            "capped at 1000 per GiB"
        );
        assert_eq!(
            iops(&io2, 1000).unwrap(),
            Some(256_000),
            "capped at the type maximum"
        );
        let low = parse(&params(&[("type", "io1"), ("iopsPerGB", "1")])).unwrap();
        assert!(iops(&low, 10).is_err());
        let auto = parse(&params(&[
            ("type", "io1"),
            ("iopsPerGB", "1"),
            ("allowAutoIOPSPerGBIncrease", "true"),
        ]))
        .unwrap();
        assert_eq!(iops(&auto, 10).unwrap(), Some(100));
        let too_many = parse(&params(&[("type", "gp3"), ("iops", "90000")])).unwrap();
        assert!(
            iops(&too_many, 1000)
                .unwrap_err()
                .to_string()
                .contains("90000")
        );
        assert!(
            iops(&parse(&params(&[("type", "io2")])).unwrap(), 10).is_err(),
            "io2 needs iops"
        );
        assert!(throughput(&parse(&params(&[("throughput", "5000")])).unwrap()).is_err());
    }

    #[test]
    fn tag_values_are_templated_from_provisioner_metadata() {
        let p = params(&[
            (
                "tagSpecification_1",
                "owner={{ .PVCNamespace }}/{{.PVCName}}",
            ),
            ("tagSpecification_2", "pv = {{ .PVName }}"),
            ("csi.storage.k8s.io/pvc/name", "data-0"),
            ("csi.storage.k8s.io/pvc/namespace", "db"),
            ("csi.storage.k8s.io/pv/name", "pvc-123"),
        ]);
        let parsed = parse(&p).unwrap();
        assert_eq!(parsed.tags.get("owner").unwrap(), "db/data-0");
        assert_eq!(parsed.tags.get("pv").unwrap(), "pvc-123");
        assert!(parse(&params(&[("tagSpecification_1", "x={{ .Nope }}")])).is_err());
        assert!(parse(&params(&[("tagSpecification_1", "novalue")])).is_err());
    }
}
