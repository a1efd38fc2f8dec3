//! The one temperature rule of every crate and tool.
//!
//! A sampling temperature is finite and `>= 0`; `0` is greedy (the target's argmax, the DFlash2
//! selector's lowest-rank argmax). NaN, infinities and negative values are refused wherever a
//! temperature enters: the engine's requests, the draft's per-row requests, the `dflash` and
//! `propose` tools.

use crate::error::{ConfigError, Result};

/// The rule in words, for every message that states it.
pub const TEMPERATURE_RULE: &str = "a finite temperature >= 0 (0: greedy)";

/// Whether `t` is an accepted temperature: finite and `>= 0`.
pub fn is_valid_temperature(t: f32) -> bool {
    t.is_finite() && t >= 0.0
}

/// `t` if it is an accepted temperature, else [`ConfigError::InvalidTemperature`] naming
/// `path` (the option, flag or field as the caller's user wrote it).
///
/// ```
/// use dflash_config::check_temperature;
/// assert_eq!(check_temperature("--temperature", 0.7), Ok(0.7));
/// let e = check_temperature("--temperature", f32::NAN).unwrap_err();
/// assert_eq!(
///     e.to_string(),
///     "`--temperature`: expected a finite temperature >= 0 (0: greedy), found NaN"
/// );
/// ```
pub fn check_temperature(path: &str, t: f32) -> Result<f32> {
    if is_valid_temperature(t) {
        Ok(t)
    } else {
        Err(ConfigError::InvalidTemperature {
            path: path.to_owned(),
            found: t.to_string(),
        })
    }
}
