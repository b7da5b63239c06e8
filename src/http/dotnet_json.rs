//! JSON text exactly as .NET's `System.Text.Json` serializer writes it with default options, for
//! payloads the seed stores and later compares byte for byte.
//!
//! serde_json escapes only what JSON requires; the .NET default encoder also escapes every
//! non-ASCII character and the HTML-sensitive `" & ' + < >` and backtick, as `\uXXXX` with
//! uppercase hex (`"` too: `\u0022`, not `\"`). Storing serde_json's spelling would make a
//! database shared with the original lab see a replay as a conflict.

use std::fmt::Write as _;

/// Writes one flat JSON object, property by property, in the order given (as .NET writes an
/// anonymous type's members in declaration order).
#[derive(Debug)]
pub struct ObjectWriter {
    text: String,
}

impl Default for ObjectWriter {
    fn default() -> Self {
        ObjectWriter::new()
    }
}

impl ObjectWriter {
    pub fn new() -> Self {
        ObjectWriter {
            text: String::from("{"),
        }
    }

    pub fn string(mut self, name: &str, value: &str) -> Self {
        self.name(name);
        write_string(&mut self.text, value);
        self
    }

    pub fn integer(mut self, name: &str, value: i64) -> Self {
        self.name(name);
        // Writing to a String cannot fail.
        let _ = write!(self.text, "{value}");
        self
    }

    pub fn finish(mut self) -> String {
        self.text.push('}');
        self.text
    }

    fn name(&mut self, name: &str) {
        if self.text.len() > 1 {
            self.text.push(',');
        }
        write_string(&mut self.text, name);
        self.text.push(':');
    }
}

/// Appends `value` as a quoted JSON string with System.Text.Json's default escaping.
pub fn write_string(out: &mut String, value: &str) {
    out.push('"');
    for character in value.chars() {
        match character {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\\' => out.push_str("\\\\"),
            '"' | '&' | '\'' | '+' | '<' | '>' | '`' => escape_utf16(out, character),
            ' '..='~' => out.push(character),
            // Control characters, DEL and everything outside ASCII.
            _ => escape_utf16(out, character),
        }
    }
    out.push('"');
}

/// `\uXXXX` per UTF-16 code unit (a surrogate pair for characters beyond the BMP).
fn escape_utf16(out: &mut String, character: char) {
    let mut units = [0u16; 2];
    for unit in character.encode_utf16(&mut units) {
        let _ = write!(out, "\\u{unit:04X}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(value: &str) -> String {
        let mut out = String::new();
        write_string(&mut out, value);
        out
    }

    #[test]
    fn plain_ascii_is_written_as_is() {
        assert_eq!(string("hello world/ok!~"), r#""hello world/ok!~""#);
    }

    #[test]
    fn html_sensitive_characters_become_uppercase_unicode_escapes() {
        assert_eq!(
            string(r#"<a href="x">'&'+`</a>"#),
            r#""\u003Ca href=\u0022x\u0022\u003E\u0027\u0026\u0027\u002B\u0060\u003C/a\u003E""#
        );
    }

    #[test]
    fn short_escapes_are_used_where_json_has_them() {
        assert_eq!(string("a\\b\n\r\t\u{8}\u{c}"), r#""a\\b\n\r\t\b\f""#);
    }

    #[test]
    fn other_control_characters_and_del_are_unicode_escapes() {
        assert_eq!(string("\u{0}\u{1f}\u{7f}"), r#""\u0000\u001F\u007F""#);
    }

    #[test]
    fn non_ascii_is_escaped_per_utf16_code_unit() {
        assert_eq!(string("é"), r#""\u00E9""#);
        assert_eq!(string("ü€"), r#""\u00FC\u20AC""#);
        assert_eq!(string("😀"), r#""\uD83D\uDE00""#);
    }

    #[test]
    fn objects_keep_member_order_and_names() {
        let text = ObjectWriter::new()
            .string("Payload", "hello")
            .integer("Amount", 2)
            .finish();
        assert_eq!(text, r#"{"Payload":"hello","Amount":2}"#);
        let receipt = ObjectWriter::new()
            .integer("Quantity", 1)
            .string("condition", "\"v1\",W/\"v2\"")
            .finish();
        assert_eq!(
            receipt,
            r#"{"Quantity":1,"condition":"\u0022v1\u0022,W/\u0022v2\u0022"}"#
        );
        assert_eq!(ObjectWriter::new().finish(), "{}");
    }

    #[test]
    fn the_output_is_json_that_reads_back_to_the_input() {
        let original = "<tag> & \"quotes\" + 'ticks' `code` é 😀 \u{1}\n";
        let text = string(original);
        let parsed: String = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed, original);
    }
}
