//! Operators: the people allowed to resolve dead letters. Authority is established outside HTTP:
//! `production-lab operator add NAME --database PATH` prints a random 32-byte token once and the
//! database keeps only its SHA-256, so a copy of the file does not hand out authority. A resolution
//! carries `Authorization: Bearer TOKEN`; the operator's name goes into the audit trail.

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};
use sha2::{Digest, Sha256};

use crate::ordering::clock;

/// Random bytes in a token.
pub const TOKEN_BYTES: usize = 32;
const NAME_MAX: usize = 64;
/// The CLI may wait this long for a running server's write transaction to finish.
const CLI_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How to register the first operator, for answers given while there is none.
pub const ADD_HINT: &str = "production-lab operator add NAME --database PATH";

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error(
        "database {0} does not exist: start the server with --database {0} first, or check the path"
    )]
    MissingDatabase(String),
    #[error(
        "'{0}' is not a valid operator name: use 1 to {NAME_MAX} letters, digits, '.', '_', '-' or '@'"
    )]
    InvalidName(String),
    #[error("an operator named '{0}' already exists")]
    AlreadyExists(String),
    #[error(
        "an operator named '{name}' was revoked at {revoked_at}; names are not reused, so that the audit trail names one person: choose another name"
    )]
    NameRetired { name: String, revoked_at: String },
    #[error("no operator named '{0}'")]
    Unknown(String),
    #[error("database {path}: {source}")]
    Database {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
}

/// An operator as `operator list` shows it: never the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorRecord {
    pub name: String,
    pub created_at: String,
    pub revoked_at: Option<String>,
}

/// What `operator revoke` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revocation {
    pub revoked_at: String,
    /// True when the operator had been revoked before (nothing changed).
    pub already: bool,
}

/// Opens an existing database for the operator commands, bringing its schema up to date with the
/// same migrations the server runs.
pub fn open_database(path: &Path) -> Result<Connection, OperatorError> {
    if !path.is_file() {
        return Err(OperatorError::MissingDatabase(path.display().to_string()));
    }
    let failed = |source| OperatorError::Database {
        path: path.display().to_string(),
        source,
    };
    let mut connection = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(failed)?;
    connection.busy_timeout(CLI_BUSY_TIMEOUT).map_err(failed)?;
    connection
        .pragma_update(None, "foreign_keys", true)
        .map_err(failed)?;
    crate::schema::migrate(&mut connection).map_err(failed)?;
    Ok(connection)
}

/// Registers `name` and returns their new token. Only its hash is stored.
pub fn add(path: &Path, name: &str) -> Result<String, OperatorError> {
    validate_name(name)?;
    let connection = open_database(path)?;
    let failed = |source| OperatorError::Database {
        path: path.display().to_string(),
        source,
    };
    if let Some(existing) = find(&connection, name).map_err(failed)? {
        return Err(match existing.revoked_at {
            Some(revoked_at) => OperatorError::NameRetired {
                name: name.to_owned(),
                revoked_at,
            },
            None => OperatorError::AlreadyExists(name.to_owned()),
        });
    }
    let token = new_token();
    connection
        .execute(
            "INSERT INTO operators(name, token_hash, created_at) VALUES (?1, ?2, ?3)",
            params![name, token_hash(&token), clock::now()],
        )
        .map_err(failed)?;
    Ok(token)
}

/// Every operator, the first registered first.
pub fn list(path: &Path) -> Result<Vec<OperatorRecord>, OperatorError> {
    let connection = open_database(path)?;
    let failed = |source| OperatorError::Database {
        path: path.display().to_string(),
        source,
    };
    let mut statement = connection
        .prepare("SELECT name, created_at, revoked_at FROM operators ORDER BY created_at, name")
        .map_err(failed)?;
    let records = statement
        .query_map([], record_from_row)
        .and_then(Iterator::collect)
        .map_err(failed)?;
    Ok(records)
}

/// Revokes `name`: their token stops working at once. Their past resolutions keep their name.
pub fn revoke(path: &Path, name: &str) -> Result<Revocation, OperatorError> {
    let connection = open_database(path)?;
    let failed = |source| OperatorError::Database {
        path: path.display().to_string(),
        source,
    };
    let existing = find(&connection, name)
        .map_err(failed)?
        .ok_or_else(|| OperatorError::Unknown(name.to_owned()))?;
    if let Some(revoked_at) = existing.revoked_at {
        return Ok(Revocation {
            revoked_at,
            already: true,
        });
    }
    let revoked_at = clock::now();
    connection
        .execute(
            "UPDATE operators SET revoked_at = ?2 WHERE name = ?1 AND revoked_at IS NULL",
            params![name, revoked_at],
        )
        .map_err(failed)?;
    Ok(Revocation {
        revoked_at,
        already: false,
    })
}

/// The active operator a token belongs to.
pub fn authenticate(connection: &Connection, token: &str) -> rusqlite::Result<Option<String>> {
    connection
        .prepare_cached("SELECT name FROM operators WHERE token_hash = ?1 AND revoked_at IS NULL")?
        .query_row([token_hash(token)], |row| row.get(0))
        .optional()
}

/// How many operators can act now.
pub fn active_count(connection: &Connection) -> rusqlite::Result<i64> {
    connection
        .prepare_cached("SELECT COUNT(*) FROM operators WHERE revoked_at IS NULL")?
        .query_row([], |row| row.get(0))
}

/// The stored form of a token: lowercase hex SHA-256 of its text.
pub fn token_hash(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

fn new_token() -> String {
    URL_SAFE_NO_PAD.encode(rand::random::<[u8; TOKEN_BYTES]>())
}

fn validate_name(name: &str) -> Result<(), OperatorError> {
    let valid = !name.is_empty()
        && name.len() <= NAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'));
    if valid {
        Ok(())
    } else {
        Err(OperatorError::InvalidName(name.to_owned()))
    }
}

fn find(connection: &Connection, name: &str) -> rusqlite::Result<Option<OperatorRecord>> {
    connection
        .query_row(
            "SELECT name, created_at, revoked_at FROM operators WHERE name = ?1",
            [name],
            record_from_row,
        )
        .optional()
}

fn record_from_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<OperatorRecord> {
    Ok(OperatorRecord {
        name: row.get(0)?,
        created_at: row.get(1)?,
        revoked_at: row.get(2)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lab.db");
        Connection::open(&path).unwrap();
        (dir, path)
    }

    #[test]
    fn tokens_are_random_and_only_their_hash_is_stored() {
        let (_dir, path) = database();
        let alice = add(&path, "alice").unwrap();
        let bob = add(&path, "bob").unwrap();
        assert_ne!(alice, bob);
        assert_eq!(URL_SAFE_NO_PAD.decode(&alice).unwrap().len(), TOKEN_BYTES);
        let connection = open_database(&path).unwrap();
        let stored: String = connection
            .query_row(
                "SELECT token_hash FROM operators WHERE name = 'alice'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(stored, token_hash(&alice));
        assert_eq!(stored.len(), 64);
        assert_eq!(
            authenticate(&connection, &alice).unwrap().as_deref(),
            Some("alice")
        );
        assert_eq!(authenticate(&connection, "guess").unwrap(), None);
    }

    #[test]
    fn a_revoked_token_stops_working_and_its_name_is_not_reused() {
        let (_dir, path) = database();
        let token = add(&path, "alice").unwrap();
        assert!(!revoke(&path, "alice").unwrap().already);
        assert!(revoke(&path, "alice").unwrap().already);
        let connection = open_database(&path).unwrap();
        assert_eq!(authenticate(&connection, &token).unwrap(), None);
        assert_eq!(active_count(&connection).unwrap(), 0);
        assert!(matches!(
            add(&path, "alice"),
            Err(OperatorError::NameRetired { .. })
        ));
        assert!(matches!(
            revoke(&path, "nobody"),
            Err(OperatorError::Unknown(_))
        ));
    }

    #[test]
    fn names_are_checked_and_a_missing_database_is_not_created() {
        let (dir, path) = database();
        for bad in ["", "has space", "x".repeat(65).as_str(), "ünï"] {
            assert!(
                matches!(add(&path, bad), Err(OperatorError::InvalidName(_))),
                "{bad:?}"
            );
        }
        let missing = dir.path().join("typo.db");
        assert!(matches!(
            add(&missing, "alice"),
            Err(OperatorError::MissingDatabase(_))
        ));
        assert!(!missing.exists());
    }
}
