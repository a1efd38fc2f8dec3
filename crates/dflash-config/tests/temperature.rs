//! The one temperature rule: finite and >= 0 (0 greedy); everything else is refused with an
//! error that names the option as the caller wrote it.

use dflash_config::{ConfigError, TEMPERATURE_RULE, check_temperature, is_valid_temperature};

#[test]
fn temperature_is_finite_and_non_negative_and_zero_is_greedy() {
    for t in [0.0, -0.0, 1e-30, 0.7, 1.0, 2.0, 1e30, f32::MAX] {
        assert!(is_valid_temperature(t), "{t}");
        assert_eq!(check_temperature("--temperature", t), Ok(t));
    }
    for (t, shown) in [
        (f32::NAN, "NaN"),
        (f32::INFINITY, "inf"),
        (f32::NEG_INFINITY, "-inf"),
        (-1.0, "-1"),
        (-1e-30, "-0.000000000000000000000000000001"),
    ] {
        assert!(!is_valid_temperature(t), "{t}");
        let e = check_temperature("temperature", t).expect_err("refused");
        assert_eq!(
            e,
            ConfigError::InvalidTemperature {
                path: "temperature".into(),
                found: shown.into()
            }
        );
        assert_eq!(e.path(), "temperature");
        assert_eq!(
            e.to_string(),
            format!("`temperature`: expected {TEMPERATURE_RULE}, found {shown}")
        );
    }
}
