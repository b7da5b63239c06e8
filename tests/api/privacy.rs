//! Tests of the privacy lab (none yet: the lab is not built).
