//! dflash-testkit (under construction).
