//! The text of a `Producer-Epoch` header, read the same way on every door (the HTTP general door
//! and the NATS broker door): the decimal number a session answered, written as the session wrote
//! it, so that `+4`, `04` or `000004` never pass for epoch 4.

pub use ordered_inbox::jetstream::wire::parse_epoch as parse;

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn an_epoch_is_written_as_its_session_wrote_it() {
        assert_eq!(parse("4"), Some(4));
        assert_eq!(parse(" 17 "), Some(17));
        assert_eq!(parse("9223372036854775807"), Some(i64::MAX));
        for refused in [
            "",
            " ",
            "0",
            "00",
            "04",
            "000004",
            "+4",
            "-4",
            "4.0",
            "4e0",
            "0x4",
            "٤",
            "4 4",
            "9223372036854775808",
            "99999999999999999999",
        ] {
            assert_eq!(parse(refused), None, "{refused:?}");
        }
    }
}
