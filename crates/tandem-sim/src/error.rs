//! The simulator's errors.

use std::path::PathBuf;

/// Why a profile could not be used or a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A profile file does not parse; `field` is the path of the offending field.
    #[error("profile {path}: field `{field}`: {message}")]
    ProfileFile {
        /// The file.
        path: PathBuf,
        /// The field (e.g. `decode.points`); empty for the whole document.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A profile parses but a field's value is unusable.
    #[error("profile field `{field}`: {message}")]
    Profile {
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A scaling setting is unusable; `field` names it as the settings file does (`decode.min`).
    #[error("scaling setting `{field}`: {message}")]
    Setting {
        /// The field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The simulated deployment or run is impossible as asked.
    #[error("{0}")]
    Config(String),
}
