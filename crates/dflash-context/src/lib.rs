//! dflash-context (under construction).
