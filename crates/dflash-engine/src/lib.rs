//! dflash-engine (under construction).
