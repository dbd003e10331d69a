//! The cluster's shared secrets: where they are read from
//! (`--cluster-secret-file`, `--cluster-secret` or `TOLLGATE_CLUSTER_SECRET`),
//! what a valid one is (at least [`SECRET_BYTES_MIN`] bytes, one per line,
//! several only while rotating), and the errors that name what is wrong.
//! A secret is never printed. The handshake that proves possession of one
//! is `auth.rs`.

use std::path::{Path, PathBuf};

/// Shortest secret accepted, in bytes.
pub const SECRET_BYTES_MIN: usize = 16;

/// One shared secret; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// The secret's bytes (the HMAC key).
    pub(super) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

/// The secrets of this node, in order: the first signs, every one is
/// accepted (several only while rotating).
#[derive(Debug, Clone)]
pub struct PeerSecrets {
    secrets: Vec<Secret>,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "cluster mode needs the cluster's shared secret, the same on every node: give \
         --cluster-secret-file PATH (or --cluster-secret / TOLLGATE_CLUSTER_SECRET). For a \
         new cluster make one with `head -c 32 /dev/urandom | base64 > \
         /etc/tollgate/cluster.secret && chmod 600 /etc/tollgate/cluster.secret` and copy \
         it to every node"
    )]
    Missing,
    #[error(
        "give either --cluster-secret-file or --cluster-secret (TOLLGATE_CLUSTER_SECRET), not both"
    )]
    Both,
    #[error("cannot read the cluster secret file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the cluster secret file {0} holds no secret (one per line; blank lines and # comments are ignored)")]
    EmptyFile(PathBuf),
    #[error("{path} line {line}: the cluster secret is {len} bytes; use at least {SECRET_BYTES_MIN} (e.g. head -c 32 /dev/urandom | base64)")]
    TooShortInFile {
        path: PathBuf,
        line: usize,
        len: usize,
    },
    #[error("--cluster-secret / TOLLGATE_CLUSTER_SECRET: secret {index} is {len} bytes; use at least {SECRET_BYTES_MIN} (e.g. head -c 32 /dev/urandom | base64)")]
    TooShortInValue { index: usize, len: usize },
    #[error("--cluster-secret / TOLLGATE_CLUSTER_SECRET holds no secret")]
    EmptyValue,
}

impl PeerSecrets {
    /// Secrets in order (first signs). Each must be ≥ [`SECRET_BYTES_MIN`].
    pub fn new(secrets: Vec<Vec<u8>>) -> Result<PeerSecrets, SecretError> {
        if secrets.is_empty() {
            return Err(SecretError::EmptyValue);
        }
        for (i, secret) in secrets.iter().enumerate() {
            if secret.len() < SECRET_BYTES_MIN {
                return Err(SecretError::TooShortInValue {
                    index: i + 1,
                    len: secret.len(),
                });
            }
        }
        Ok(PeerSecrets {
            secrets: secrets.into_iter().map(Secret).collect(),
        })
    }

    /// The secrets the flags give: a file, or a comma-separated value.
    pub fn from_flags(
        file: Option<&Path>,
        value: Option<&str>,
    ) -> Result<PeerSecrets, SecretError> {
        match (file, value.filter(|v| !v.is_empty())) {
            (Some(_), Some(_)) => Err(SecretError::Both),
            (Some(path), None) => PeerSecrets::load(path),
            (None, Some(value)) => PeerSecrets::parse_value(value),
            (None, None) => Err(SecretError::Missing),
        }
    }

    /// `a,b,c`: spaces around each secret are trimmed, empty items skipped.
    pub fn parse_value(value: &str) -> Result<PeerSecrets, SecretError> {
        let secrets: Vec<Vec<u8>> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.as_bytes().to_vec())
            .collect();
        PeerSecrets::new(secrets)
    }

    /// One secret per line (trimmed); blank lines and `#` comments ignored.
    /// Warns when the file is readable by its group or others.
    pub fn load(path: &Path) -> Result<PeerSecrets, SecretError> {
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(meta) = std::fs::metadata(path) {
                let mode = meta.permissions().mode();
                if mode & 0o077 != 0 {
                    tracing::warn!(
                        "the cluster secret file {} is readable by other users (mode {:o}); chmod 600 it",
                        path.display(),
                        mode & 0o777
                    );
                }
            }
        }
        let mut secrets = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.len() < SECRET_BYTES_MIN {
                return Err(SecretError::TooShortInFile {
                    path: path.to_path_buf(),
                    line: number + 1,
                    len: line.len(),
                });
            }
            secrets.push(line.as_bytes().to_vec());
        }
        if secrets.is_empty() {
            return Err(SecretError::EmptyFile(path.to_path_buf()));
        }
        PeerSecrets::new(secrets)
    }

    pub fn len(&self) -> usize {
        self.secrets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// Every secret, the signing one first.
    pub(super) fn all(&self) -> &[Secret] {
        &self.secrets
    }

    pub(super) fn signing(&self) -> &Secret {
        &self.secrets[0]
    }
}
