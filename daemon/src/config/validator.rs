//! The config's error type, and the validator that writes its messages: each names
//! the file and the field.

use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Invalid {
        path: PathBuf,
        field: String,
        message: String,
    },
}

/// Errors that name the file and the field.
pub(super) struct Validator<'a> {
    pub(super) path: &'a Path,
}

impl Validator<'_> {
    pub(super) fn err(&self, field: &str, message: String) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            message,
        }
    }

    pub(super) fn duration(
        &self,
        field: &str,
        value: Option<String>,
        default: &str,
    ) -> Result<Duration, ConfigError> {
        let s = value.unwrap_or_else(|| default.to_string());
        humantime::parse_duration(&s).map_err(|e| {
            self.err(
                field,
                format!("{s:?} is not a duration like \"30s\" or \"1h\": {e}"),
            )
        })
    }
}
