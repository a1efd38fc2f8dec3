//! Loading with a report: the draft's `config.json` parsed in a chosen [`ParseMode`], every
//! error naming the file, and what the parser found besides the config (unknown fields, notes
//! on what it assumed) handed back to the caller instead of dropped.

use std::path::{Path, PathBuf};

use dflash_config::{
    ConfigError, ConfigNote, DraftConfig, Geometry, ParseMode, TargetTextConfig, UnknownField,
    validate_pair,
};
use dflash_ops::Backend;

use crate::model::DraftModel;
use crate::weights::{BindOptions, CONFIG_FILE, Checkpoint, DraftWeights};
use crate::{DraftError, Result};

/// What parsing a draft's `config.json` reported besides the config itself.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigReport {
    /// The config file, as opened.
    pub path: PathBuf,
    /// Fields the parser does not know, in document order (always empty in strict mode).
    pub unknown_fields: Vec<UnknownField>,
    /// What the parser assumed for absent or derived fields.
    pub notes: Vec<ConfigNote>,
}

impl ConfigReport {
    /// One line per unknown field, naming the file: `FILE: `path` = value: unknown field, not
    /// read`. A tool prints these as warnings.
    pub fn warnings(&self) -> Vec<String> {
        self.unknown_fields
            .iter()
            .map(|u| format!("{}: {u}", self.path.display()))
            .collect()
    }

    /// One line per note, naming the file: `FILE: `path`: what was assumed`.
    pub fn note_lines(&self) -> Vec<String> {
        self.notes
            .iter()
            .map(|n| format!("{}: {n}", self.path.display()))
            .collect()
    }
}

/// Wrap a config error with the file it came from.
pub fn config_file_error(path: &Path, source: ConfigError) -> DraftError {
    DraftError::ConfigFile {
        path: path.display().to_string(),
        source: Box::new(source),
    }
}

/// Parse the draft config text `text` (read from `path`, which only names it) in `mode` and
/// validate it against `target`. Errors are [`DraftError::ConfigFile`] naming `path`.
pub fn parse_draft_config(
    path: &Path,
    text: &str,
    target: &TargetTextConfig,
    mode: ParseMode,
) -> Result<(DraftConfig, Geometry, ConfigReport)> {
    let parsed = DraftConfig::from_json_str(text, mode).map_err(|e| config_file_error(path, e))?;
    let geometry = validate_pair(&parsed.value, target).map_err(|e| config_file_error(path, e))?;
    let report = ConfigReport {
        path: path.to_path_buf(),
        unknown_fields: parsed.unknown_fields,
        notes: parsed.notes,
    };
    Ok((parsed.value, geometry, report))
}

impl Checkpoint {
    /// The path of this checkpoint's `config.json`.
    pub fn config_path(&self) -> PathBuf {
        self.dir().join(CONFIG_FILE)
    }

    /// Parse this checkpoint's `config.json` in `mode` and validate it against `target`:
    /// [`parse_draft_config`] on [`Checkpoint::config_json`].
    pub fn draft_config(
        &self,
        target: &TargetTextConfig,
        mode: ParseMode,
    ) -> Result<(DraftConfig, Geometry, ConfigReport)> {
        parse_draft_config(&self.config_path(), self.config_json(), target, mode)
    }
}

impl DraftModel {
    /// [`DraftModel::load`] with the config parsed in `mode`: errors name the config file, and
    /// the [`ConfigReport`] (unknown fields, notes) comes back with the model.
    pub fn load_reported(
        be: &Backend,
        dir: impl AsRef<Path>,
        target: &TargetTextConfig,
        opts: &BindOptions,
        mode: ParseMode,
    ) -> Result<(Self, ConfigReport)> {
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint_reported(be, &ck, target, opts, mode)
    }

    /// [`DraftModel::load_reported`] from an opened checkpoint.
    pub fn from_checkpoint_reported(
        be: &Backend,
        ck: &Checkpoint,
        target: &TargetTextConfig,
        opts: &BindOptions,
        mode: ParseMode,
    ) -> Result<(Self, ConfigReport)> {
        let (_, geometry, report) = ck.draft_config(target, mode)?;
        let weights = DraftWeights::bind(be, ck, &geometry, opts)?;
        Ok((Self::from_parts(be, geometry, weights), report))
    }
}
