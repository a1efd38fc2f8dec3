//! dflash-config (under construction).
