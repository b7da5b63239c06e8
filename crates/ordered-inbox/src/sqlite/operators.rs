//! Operators and producers in the SQLite file: the `operator|producer add|list|revoke` commands
//! open the file directly (the server may be running: they wait for its write transactions) and
//! bring the schema up to date first. Both registries share this code ([`Registry`]); the
//! operator functions keep their names.

use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, params};

use crate::clock;
use crate::operators::{
    OperatorCheck, OperatorError, OperatorRecord, Registry, Revocation, new_token, token_hash,
    validate_name,
};

/// How long a command waits for a running server's write transaction to finish.
const CLI_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens an existing database file for the operator commands, bringing the inbox's schema up to
/// date with the same migrations the server runs.
pub fn open_database(path: &Path) -> Result<Connection, OperatorError> {
    if !path.is_file() {
        return Err(OperatorError::MissingDatabase(path.display().to_string()));
    }
    let mut connection = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(failed(path))?;
    connection
        .busy_timeout(CLI_BUSY_TIMEOUT)
        .map_err(failed(path))?;
    connection
        .pragma_update(None, "foreign_keys", true)
        .map_err(failed(path))?;
    super::schema::migrate(&mut connection).map_err(failed(path))?;
    Ok(connection)
}

fn failed(path: &Path) -> impl Fn(rusqlite::Error) -> OperatorError + '_ {
    move |error| OperatorError::Store {
        path: path.display().to_string(),
        reason: error.to_string(),
    }
}

/// Registers an operator and returns their new token. Only its hash is stored.
pub fn add(path: &Path, name: &str) -> Result<String, OperatorError> {
    add_to(Registry::Operators, path, name)
}

/// Every operator, the first registered first.
pub fn list(path: &Path) -> Result<Vec<OperatorRecord>, OperatorError> {
    list_of(Registry::Operators, path)
}

/// Revokes an operator: their token stops working at once. Their past resolutions keep their name.
pub fn revoke(path: &Path, name: &str) -> Result<Revocation, OperatorError> {
    revoke_in(Registry::Operators, path, name)
}

/// Registers `name` in `registry` and returns the new token. Only its hash is stored; a name is
/// never reused, even after revocation.
pub fn add_to(registry: Registry, path: &Path, name: &str) -> Result<String, OperatorError> {
    validate_name(registry, name)?;
    let connection = open_database(path)?;
    if let Some(existing) = find(&connection, registry, name).map_err(failed(path))? {
        return Err(match existing.revoked_at {
            Some(revoked_at) => OperatorError::NameRetired {
                registry,
                name: name.to_owned(),
                revoked_at,
            },
            None => OperatorError::AlreadyExists(registry, name.to_owned()),
        });
    }
    let token = new_token();
    connection
        .execute(
            &format!(
                "INSERT INTO {}(name, token_hash, created_at) VALUES (?1, ?2, ?3)",
                registry.table()
            ),
            params![name, token_hash(&token), clock::now()],
        )
        .map_err(failed(path))?;
    Ok(token)
}

/// Every member of `registry`, the first registered first.
pub fn list_of(registry: Registry, path: &Path) -> Result<Vec<OperatorRecord>, OperatorError> {
    let connection = open_database(path)?;
    let mut statement = connection
        .prepare(&format!(
            "SELECT name, created_at, revoked_at FROM {} ORDER BY created_at, name",
            registry.table()
        ))
        .map_err(failed(path))?;
    let records = statement
        .query_map([], record_from_row)
        .and_then(Iterator::collect)
        .map_err(failed(path))?;
    Ok(records)
}

/// Revokes `name` in `registry`: the token stops working at once.
pub fn revoke_in(registry: Registry, path: &Path, name: &str) -> Result<Revocation, OperatorError> {
    let connection = open_database(path)?;
    let existing = find(&connection, registry, name)
        .map_err(failed(path))?
        .ok_or_else(|| OperatorError::Unknown(registry, name.to_owned()))?;
    if let Some(revoked_at) = existing.revoked_at {
        return Ok(Revocation {
            revoked_at,
            already: true,
        });
    }
    let revoked_at = clock::now();
    connection
        .execute(
            &format!(
                "UPDATE {} SET revoked_at = ?2 WHERE name = ?1 AND revoked_at IS NULL",
                registry.table()
            ),
            params![name, revoked_at],
        )
        .map_err(failed(path))?;
    Ok(Revocation {
        revoked_at,
        already: false,
    })
}

/// The active member of `registry` a token belongs to.
pub fn holder(
    connection: &Connection,
    registry: Registry,
    token: &str,
) -> rusqlite::Result<Option<String>> {
    connection
        .prepare_cached(&format!(
            "SELECT name FROM {} WHERE token_hash = ?1 AND revoked_at IS NULL",
            registry.table()
        ))?
        .query_row([token_hash(token)], |row| row.get(0))
        .optional()
}

/// Who a token belongs to, and how many operators can act now.
pub fn check(connection: &Connection, token: Option<&str>) -> rusqlite::Result<OperatorCheck> {
    let operator = match token {
        Some(token) => holder(connection, Registry::Operators, token)?,
        None => None,
    };
    let active = connection
        .prepare_cached("SELECT COUNT(*) FROM operators WHERE revoked_at IS NULL")?
        .query_row([], |row| row.get(0))?;
    Ok(OperatorCheck { operator, active })
}

/// Whether `name` is an operator who has not been revoked.
pub fn is_active(connection: &Connection, name: &str) -> rusqlite::Result<bool> {
    connection
        .prepare_cached(
            "SELECT EXISTS(SELECT 1 FROM operators WHERE name = ?1 AND revoked_at IS NULL)",
        )?
        .query_row([name], |row| row.get(0))
}

fn find(
    connection: &Connection,
    registry: Registry,
    name: &str,
) -> rusqlite::Result<Option<OperatorRecord>> {
    connection
        .query_row(
            &format!(
                "SELECT name, created_at, revoked_at FROM {} WHERE name = ?1",
                registry.table()
            ),
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
    fn only_the_hash_is_stored_and_the_token_authenticates() {
        let (_dir, path) = database();
        let alice = add(&path, "alice").unwrap();
        let connection = open_database(&path).unwrap();
        let stored: String = connection
            .query_row(
                "SELECT token_hash FROM operators WHERE name = 'alice'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(stored, token_hash(&alice));
        let known = check(&connection, Some(&alice)).unwrap();
        assert_eq!(
            (known.operator.as_deref(), known.active),
            (Some("alice"), 1)
        );
        assert_eq!(check(&connection, Some("guess")).unwrap().operator, None);
    }

    #[test]
    fn a_revoked_token_stops_working_and_its_name_is_not_reused() {
        let (_dir, path) = database();
        let token = add(&path, "alice").unwrap();
        assert!(!revoke(&path, "alice").unwrap().already);
        assert!(revoke(&path, "alice").unwrap().already);
        let connection = open_database(&path).unwrap();
        assert_eq!(
            check(&connection, Some(&token)).unwrap(),
            OperatorCheck {
                operator: None,
                active: 0
            }
        );
        assert!(!is_active(&connection, "alice").unwrap());
        assert!(matches!(
            add(&path, "alice"),
            Err(OperatorError::NameRetired { .. })
        ));
        assert!(matches!(
            revoke(&path, "nobody"),
            Err(OperatorError::Unknown(..))
        ));
    }

    #[test]
    fn producers_share_the_registry_and_their_names_are_not_reused_either() {
        let (_dir, path) = database();
        let billing = add_to(Registry::Producers, &path, "billing").unwrap();
        // The registries are separate: an operator may share a producer's name.
        add(&path, "billing").unwrap();
        let connection = open_database(&path).unwrap();
        assert_eq!(
            holder(&connection, Registry::Producers, &billing)
                .unwrap()
                .as_deref(),
            Some("billing")
        );
        assert_eq!(check(&connection, Some(&billing)).unwrap().operator, None);
        assert!(
            !revoke_in(Registry::Producers, &path, "billing")
                .unwrap()
                .already
        );
        assert_eq!(
            holder(&connection, Registry::Producers, &billing).unwrap(),
            None
        );
        let retired = add_to(Registry::Producers, &path, "billing").unwrap_err();
        assert!(matches!(retired, OperatorError::NameRetired { .. }));
        assert!(retired.to_string().contains("producer 'billing'"));
        assert_eq!(list_of(Registry::Producers, &path).unwrap().len(), 1);
    }

    #[test]
    fn a_missing_database_is_not_created() {
        let (dir, _path) = database();
        let missing = dir.path().join("typo.db");
        assert!(matches!(
            add(&missing, "alice"),
            Err(OperatorError::MissingDatabase(_))
        ));
        assert!(!missing.exists());
        assert!(matches!(
            add(&missing, "has space"),
            Err(OperatorError::InvalidName(..))
        ));
    }
}
