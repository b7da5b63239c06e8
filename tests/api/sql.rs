//! Tests of the sql lab (none yet: the lab is not built).
