//! dflash-draft (under construction).
