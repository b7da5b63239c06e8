//! Tests of the security lab (none yet: the lab is not built).
