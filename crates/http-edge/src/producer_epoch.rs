//! The text of a `Producer-Epoch` header, read the same way on every door (the HTTP general door
//! and the NATS broker door): the decimal number a session answered, written as the session wrote
//! it, so that `+4`, `04` or `000004` never pass for epoch 4.

/// The largest number of digits an epoch can have (`i64::MAX` has 19).
const MAX_DIGITS: usize = 19;

/// The epoch `text` names: ASCII digits only, no sign, no leading zero, at least 1, at most
/// `i64::MAX`. Whitespace around the value is not part of it (HTTP's optional whitespace, a NATS
/// header written with a space after the colon). `None` for anything else.
pub fn parse(text: &str) -> Option<i64> {
    let digits = text.trim();
    let canonical = (1..=MAX_DIGITS).contains(&digits.len())
        && digits.bytes().all(|byte| byte.is_ascii_digit())
        && !digits.starts_with('0');
    if !canonical {
        return None;
    }
    digits.parse::<i64>().ok()
}

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
