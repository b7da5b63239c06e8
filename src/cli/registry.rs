//! `production-lab operator …` and `production-lab producer …`: the two registries of people and
//! services that may act on the inbox (add prints a token once; list; revoke), on the server's
//! SQLite file or its PostgreSQL inbox.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use ordered_inbox::operators::Registry;

use super::block_on;

/// `add NAME`, `list` and `revoke NAME` on one registry's store. The help of each is the
/// registry's own ([`operator_help`], [`producer_help`]).
#[derive(Subcommand)]
pub enum RegistryCommand {
    Add {
        name: String,
        #[command(flatten)]
        database: OperatorDatabase,
    },
    List {
        #[command(flatten)]
        database: OperatorDatabase,
    },
    Revoke {
        name: String,
        #[command(flatten)]
        database: OperatorDatabase,
    },
}

/// What `--help` says of one registry's commands.
struct RegistryHelp {
    add: &'static str,
    add_name: &'static str,
    list: &'static str,
    revoke: &'static str,
}

const OPERATOR_HELP: RegistryHelp = RegistryHelp {
    add: "Register an operator and print their new token once (only its hash is stored)",
    add_name: "1..64 letters, digits, '.', '_', '-' or '@'",
    list: "List operators with their created and revoked times (never tokens)",
    revoke: "Revoke an operator: their token stops working at once",
};

const PRODUCER_HELP: RegistryHelp = RegistryHelp {
    add: "Register a producer and print its new token once (only its hash is stored)",
    add_name: "1..64 letters, digits, '.', '_', '-' or '@'; never reused after revocation",
    list: "List producers with their created and revoked times (never tokens)",
    revoke: "Revoke a producer: its token stops working at once, its deliveries get 401",
};

impl RegistryHelp {
    /// Gives one of the [`RegistryCommand`]s its words.
    fn describe(&self, command: clap::Command) -> clap::Command {
        match command.get_name() {
            "add" => command
                .about(self.add)
                .mut_arg("name", |name| name.help(self.add_name)),
            "list" => command.about(self.list),
            "revoke" => command.about(self.revoke),
            _ => command,
        }
    }
}

/// The operator registry's words for each of its commands (`mut_subcommands`).
pub fn operator_help(command: clap::Command) -> clap::Command {
    OPERATOR_HELP.describe(command)
}

/// The producer registry's words for each of its commands (`mut_subcommands`).
pub fn producer_help(command: clap::Command) -> clap::Command {
    PRODUCER_HELP.describe(command)
}

#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct OperatorDatabase {
    /// The server's SQLite file (it must exist).
    #[arg(long, alias = "Production:DatabasePath")]
    pub database: Option<PathBuf>,
    /// The servers' PostgreSQL inbox, postgres://USER@127.0.0.1:PORT/DB (as given to serve --inbox).
    #[arg(long)]
    pub inbox: Option<String>,
}

impl OperatorDatabase {
    /// Where the operators live: the SQLite file, or the PostgreSQL inbox.
    fn store(self) -> OperatorStore {
        match (self.inbox, self.database) {
            (Some(url), _) => OperatorStore::Postgres(url),
            (None, Some(path)) => OperatorStore::Sqlite(path),
            // clap's group requires one of the two.
            (None, None) => OperatorStore::Sqlite(PathBuf::new()),
        }
    }
}

pub enum OperatorStore {
    Sqlite(PathBuf),
    Postgres(String),
}

/// Runs one command on `registry`.
pub fn run(registry: Registry, command: RegistryCommand) -> anyhow::Result<()> {
    use ordered_inbox::sqlite::operators::{add_to, list_of, revoke_in};
    match command {
        RegistryCommand::Add { name, database } => {
            let token = match database.store() {
                OperatorStore::Sqlite(path) => add_to(registry, &path, &name)?,
                OperatorStore::Postgres(url) => block_on(
                    ordered_inbox::postgres::operators::add_to(registry, &url, &name),
                )??,
            };
            // The token alone on stdout, so that a script can capture it; the advice on stderr.
            println!("{token}");
            eprintln!(
                "{registry} '{name}' added; this token is shown only once: send it as Authorization: Bearer TOKEN"
            );
        }
        RegistryCommand::List { database } => {
            let records = match database.store() {
                OperatorStore::Sqlite(path) => list_of(registry, &path)?,
                OperatorStore::Postgres(url) => {
                    block_on(ordered_inbox::postgres::operators::list_of(registry, &url))??
                }
            };
            for record in records {
                let state = match &record.revoked_at {
                    Some(revoked_at) => format!("revoked {revoked_at}"),
                    None => "active".to_owned(),
                };
                println!("{}\tcreated {}\t{state}", record.name, record.created_at);
            }
        }
        RegistryCommand::Revoke { name, database } => {
            let revocation = match database.store() {
                OperatorStore::Sqlite(path) => revoke_in(registry, &path, &name)?,
                OperatorStore::Postgres(url) => block_on(
                    ordered_inbox::postgres::operators::revoke_in(registry, &url, &name),
                )??,
            };
            if revocation.already {
                println!("{name} was already revoked at {}", revocation.revoked_at);
            } else {
                println!("{name} revoked at {}", revocation.revoked_at);
            }
        }
    }
    Ok(())
}
