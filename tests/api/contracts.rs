//! Tests of the contracts lab (none yet: the lab is not built).
