//! Operators: the people allowed to resolve dead letters. Authority is established outside the
//! inbox's request path: registering an operator makes a random 32-byte token, shown once, and the
//! store keeps only its SHA-256, so a copy of the store does not hand out authority. A resolution
//! names the operator the token belongs to; the name goes into the audit trail and is never reused.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use sha2::{Digest, Sha256};

/// Random bytes in a token.
pub const TOKEN_BYTES: usize = 32;
/// The longest operator name.
pub const NAME_MAX: usize = 64;

/// An operator as a listing shows it: never the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorRecord {
    /// The operator's name.
    pub name: String,
    /// When it was registered.
    pub created_at: String,
    /// When it was revoked (`None`: active).
    pub revoked_at: Option<String>,
}

/// What a revocation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    /// When the name was revoked.
    pub revoked_at: String,
    /// True when the operator had been revoked before (nothing changed).
    pub already: bool,
}

/// Who a presented token belongs to, and whether anyone could act at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorCheck {
    /// The active operator the token belongs to.
    pub operator: Option<String>,
    /// How many operators are active (0: none was ever registered, or all were revoked).
    pub active: i64,
}

/// The two kinds of registered principal, sharing names, tokens and revocation: operators (who
/// resolve dead letters and transfer aggregates) and producers (who write aggregates' sequences).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registry {
    /// The operators, who resolve.
    Operators,
    /// The producers, who deliver under sessions and epochs.
    Producers,
}

impl Registry {
    /// The table that holds this registry's rows.
    pub fn table(self) -> &'static str {
        match self {
            Registry::Operators => "operators",
            Registry::Producers => "producers",
        }
    }

    /// The word for one member, in messages.
    pub fn noun(self) -> &'static str {
        match self {
            Registry::Operators => "operator",
            Registry::Producers => "producer",
        }
    }
}

impl std::fmt::Display for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.noun())
    }
}

/// Why an operator (or producer) command was refused.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error(
        "database {0} does not exist: start the server with --database {0} first, or check the path"
    )]
    /// The database file does not exist.
    MissingDatabase(String),
    #[error(
        "'{1}' is not a valid {0} name: use 1 to {NAME_MAX} letters, digits, '.', '_', '-' or '@'"
    )]
    /// The name is not a valid name.
    InvalidName(Registry, String),
    #[error("the {0} '{1}' already exists")]
    /// The name is taken.
    AlreadyExists(Registry, String),
    #[error(
        "the {registry} '{name}' was revoked at {revoked_at}; names are not reused, so that the audit trail names one {registry}: choose another name"
    )]
    /// The name was revoked; names are not reused.
    NameRetired {
        /// The registry.
        registry: Registry,
        /// The name.
        name: String,
        /// When it was revoked.
        revoked_at: String,
    },
    #[error("no {0} named '{1}'")]
    /// No one has the name.
    Unknown(Registry, String),
    /// The database failed.
    #[error("database {path}: {reason}")]
    Store {
        /// The database's path.
        path: String,
        /// What failed.
        reason: String,
    },
}

/// The stored form of a token: lowercase hex SHA-256 of its text.
pub fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// A new random token, URL-safe base64 without padding.
pub fn new_token() -> String {
    URL_SAFE_NO_PAD.encode(rand::random::<[u8; TOKEN_BYTES]>())
}

/// 1 to [`NAME_MAX`] letters, digits, `.`, `_`, `-` or `@`.
pub fn validate_name(registry: Registry, name: &str) -> Result<(), OperatorError> {
    let valid = !name.is_empty()
        && name.len() <= NAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'));
    if valid {
        Ok(())
    } else {
        Err(OperatorError::InvalidName(registry, name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_hash_to_sixty_four_hex_digits() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert_eq!(URL_SAFE_NO_PAD.decode(&a).unwrap().len(), TOKEN_BYTES);
        let hash = token_hash(&a);
        assert_eq!(hash.len(), 64);
        assert!(
            hash.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_eq!(hash, token_hash(&a));
    }

    #[test]
    fn names_are_short_and_plain() {
        for good in ["alice", "ops.on-call_1", "a@b"] {
            assert!(validate_name(Registry::Operators, good).is_ok(), "{good}");
        }
        for bad in ["", "has space", &"x".repeat(65), "ünï"] {
            assert!(validate_name(Registry::Producers, bad).is_err(), "{bad:?}");
        }
    }
}
