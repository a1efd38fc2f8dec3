//! dflash-verify (under construction).
