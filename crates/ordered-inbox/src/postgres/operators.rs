//! Operators and producers in the PostgreSQL database: the `operator|producer add|list|revoke`
//! commands connect to the database directly (servers may be running against it) and bring the
//! schema up to date first, with the same migrations the servers run. Both registries share this
//! code ([`Registry`]); the operator functions keep their names.

use futures_util::join;
use tokio_postgres::types::ToSql;

use super::connection::{Client, Counters, Failure, PostgresError, Target, error_text};
use crate::clock;
use crate::operators::{
    OperatorCheck, OperatorError, OperatorRecord, Registry, Revocation, new_token, token_hash,
    validate_name,
};

const CHECK_TOKEN: &str = "SELECT name FROM operators WHERE token_hash = $1 AND revoked_at IS NULL";
const ACTIVE_COUNT: &str = "SELECT COUNT(*) FROM operators WHERE revoked_at IS NULL";
const PRODUCER_BY_TOKEN: &str =
    "SELECT name FROM producers WHERE token_hash = $1 AND revoked_at IS NULL";

/// The active producer a token belongs to.
pub(super) async fn producer(
    client: &Client,
    counters: &Counters,
    token: &str,
) -> Result<Option<String>, Failure> {
    let statement = client.prepare_cached(PRODUCER_BY_TOKEN).await?;
    let row = client.query_opt(&statement, &[&token_hash(token)]).await;
    counters.trip();
    Ok(match row? {
        Some(row) => Some(row.try_get(0)?),
        None => None,
    })
}

/// Who a token belongs to, and how many operators can act now.
pub(super) async fn check(
    client: &Client,
    counters: &Counters,
    token: Option<&str>,
) -> Result<OperatorCheck, Failure> {
    let by_token = client.prepare_cached(CHECK_TOKEN).await?;
    let active = client.prepare_cached(ACTIVE_COUNT).await?;
    let hash = token.map(token_hash).unwrap_or_default();
    let by_hash: [&(dyn ToSql + Sync); 1] = [&hash];
    let (operator, active) = join!(
        client.query_opt(&by_token, &by_hash),
        client.query_one(&active, &[]),
    );
    counters.trip();
    let operator = match (token, operator?) {
        (Some(_), Some(row)) => Some(row.try_get(0)?),
        _ => None,
    };
    Ok(OperatorCheck {
        operator,
        active: active?.try_get(0)?,
    })
}

/// Where an operator command finds the database: a loopback URL (checked by [`Target::parse`])
/// or a target its caller checked by its own rule (a gate's store on another host, over TLS).
#[derive(Debug, Clone, Copy)]
pub enum Database<'a> {
    /// A URL, checked by [`Target::parse`].
    Url(&'a str),
    /// A target its caller checked.
    Target(&'a Target),
}

impl<'a> From<&'a str> for Database<'a> {
    fn from(url: &'a str) -> Self {
        Database::Url(url)
    }
}

impl<'a> From<&'a String> for Database<'a> {
    fn from(url: &'a String) -> Self {
        Database::Url(url)
    }
}

impl<'a> From<&'a Target> for Database<'a> {
    fn from(target: &'a Target) -> Self {
        Database::Target(target)
    }
}

/// Connects for an operator command and migrates the schema.
async fn open(database: Database<'_>) -> Result<(Target, tokio_postgres::Client), OperatorError> {
    let target = match database {
        Database::Url(url) => {
            Target::parse(url).map_err(|error| store_error(url_label(url), error))?
        }
        Database::Target(target) => target.clone(),
    };
    super::schema::migrate(&target)
        .await
        .map_err(|error| store_error(target.to_string(), error))?;
    let client = target
        .connect()
        .await
        .map_err(|error| store_error(target.to_string(), error))?;
    Ok((target, client))
}

/// What an error may say about a URL that could not be parsed: never the URL itself, which may
/// hold a password.
fn url_label(url: &str) -> String {
    if url.starts_with("postgres") {
        "the --inbox URL".to_owned()
    } else {
        "--inbox".to_owned()
    }
}

fn store_error(path: String, error: PostgresError) -> OperatorError {
    let reason = match error {
        // The target is already the error's `path`.
        PostgresError::Connect { reason, .. } => reason,
        other => other.to_string(),
    };
    OperatorError::Store { path, reason }
}

fn failed(target: &Target) -> impl Fn(tokio_postgres::Error) -> OperatorError + '_ {
    move |error| OperatorError::Store {
        path: target.to_string(),
        reason: error_text(&error),
    }
}

async fn find(
    client: &tokio_postgres::Client,
    registry: Registry,
    name: &str,
) -> Result<Option<OperatorRecord>, tokio_postgres::Error> {
    // The table name is one of two fixed words ([`Registry::table`]), never input.
    let find = format!(
        "SELECT name, created_at, revoked_at FROM {} WHERE name = $1",
        registry.table()
    );
    client
        .query_opt(&find, &[&name])
        .await?
        .map(|row| {
            Ok(OperatorRecord {
                name: row.try_get(0)?,
                created_at: row.try_get(1)?,
                revoked_at: row.try_get(2)?,
            })
        })
        .transpose()
}

/// Registers an operator and returns their new token. Only its hash is stored.
pub async fn add(url: &str, name: &str) -> Result<String, OperatorError> {
    add_to(Registry::Operators, url, name).await
}

/// Every operator, the first registered first.
pub async fn list(url: &str) -> Result<Vec<OperatorRecord>, OperatorError> {
    list_of(Registry::Operators, url).await
}

/// Revokes an operator: their token stops working at once. Their past resolutions keep their
/// name.
pub async fn revoke(url: &str, name: &str) -> Result<Revocation, OperatorError> {
    revoke_in(Registry::Operators, url, name).await
}

/// Registers `name` in `registry` and returns the new token. Only its hash is stored; a name is
/// never reused, even after revocation.
pub async fn add_to(
    registry: Registry,
    database: impl Into<Database<'_>>,
    name: &str,
) -> Result<String, OperatorError> {
    validate_name(registry, name)?;
    let (target, client) = open(database.into()).await?;
    if let Some(existing) = find(&client, registry, name)
        .await
        .map_err(failed(&target))?
    {
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
    let inserted = client
        .execute(
            &format!(
                "INSERT INTO {}(name, token_hash, created_at) VALUES ($1, $2, $3)
                 ON CONFLICT (name) DO NOTHING",
                registry.table()
            ),
            &[&name, &token_hash(&token), &clock::now()],
        )
        .await
        .map_err(failed(&target))?;
    if inserted == 0 {
        // Another command registered the name between the check and the insert.
        return Err(OperatorError::AlreadyExists(registry, name.to_owned()));
    }
    Ok(token)
}

/// Every member of `registry`, the first registered first.
pub async fn list_of(
    registry: Registry,
    database: impl Into<Database<'_>>,
) -> Result<Vec<OperatorRecord>, OperatorError> {
    let (target, client) = open(database.into()).await?;
    let rows = client
        .query(
            &format!(
                "SELECT name, created_at, revoked_at FROM {} ORDER BY created_at, name",
                registry.table()
            ),
            &[],
        )
        .await
        .map_err(failed(&target))?;
    rows.iter()
        .map(|row| {
            Ok(OperatorRecord {
                name: row.try_get(0)?,
                created_at: row.try_get(1)?,
                revoked_at: row.try_get(2)?,
            })
        })
        .collect::<Result<_, tokio_postgres::Error>>()
        .map_err(failed(&target))
}

/// Revokes `name` in `registry`: the token stops working at once.
pub async fn revoke_in(
    registry: Registry,
    database: impl Into<Database<'_>>,
    name: &str,
) -> Result<Revocation, OperatorError> {
    let (target, client) = open(database.into()).await?;
    let revoked_at = clock::now();
    let updated = client
        .execute(
            &format!(
                "UPDATE {} SET revoked_at = $2 WHERE name = $1 AND revoked_at IS NULL",
                registry.table()
            ),
            &[&name, &revoked_at],
        )
        .await
        .map_err(failed(&target))?;
    if updated == 1 {
        return Ok(Revocation {
            revoked_at,
            already: false,
        });
    }
    match find(&client, registry, name)
        .await
        .map_err(failed(&target))?
    {
        Some(OperatorRecord {
            revoked_at: Some(revoked_at),
            ..
        }) => Ok(Revocation {
            revoked_at,
            already: true,
        }),
        _ => Err(OperatorError::Unknown(registry, name.to_owned())),
    }
}
