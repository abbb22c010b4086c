//! The server's config file on any text: never a panic; a file that is accepted gives
//! settings whose every limit is a valid config; one that is refused says why.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate_server::config::{FileConfig, Overrides};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match FileConfig::parse(text) {
        Ok(file) => match file.settings(&Overrides::default(), false) {
            Ok(settings) => {
                for (name, config) in &settings.limits {
                    assert!(!name.is_empty());
                    assert!(config.rate() > 0.0 && config.period() > 0.0, "{name}: {config:?}");
                }
            }
            Err(e) => assert!(!format!("{e:#}").is_empty()),
        },
        Err(e) => assert!(!format!("{e:#}").is_empty()),
    }
});
