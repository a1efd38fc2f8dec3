//! dflash-ops (under construction).
