//! Tests of the messaging lab (none yet: the lab is not built).
