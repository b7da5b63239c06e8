"""The deliberate exclusions of the schema fuzzing run by .ci/schemathesis (docs/operating.md names each).

The lab has controls that hold or cut requests on purpose, and fault switches that answer 503 on
purpose. A fuzzer that switches them in random order would make later, unrelated requests wait
without bound or lose their connection, and would report the documented 503 as a server error.
Everything else the fuzzer finds fails the run.
"""

import schemathesis

# A closed gate holds every later GET /cache/shared or POST /worker until it is opened again.
GATES = {"/lab/cache/gate/{action}", "/lab/worker/gate/{action}"}

# Fault switches that do the work, then answer 503 (before the commit, or after it as a lost
# success). Their 503 is documented; any other status they answer is still checked.
FAULT_SWITCHES = {
    ("POST", "/outbox/orders"): "failbeforecommit",
    ("POST", "/inbox/apply"): "failbeforecommit",
    ("POST", "/cache/catalog"): "failbeforecommit",
    ("POST", "/pipeline"): "failaftercommit",
}

# Answers 503 on every call, by design (a controlled failure before or after a commit).
ALWAYS_FAILS = {("POST", "/contracts/change/{phase}")}


# The gate's applied feed waits up to waitMs (at most 30 s) for a message when there is none yet:
# a long wait is its documented behaviour, and longer than the run's request timeout.
LONG_POLLS = {"/v1/aggregates/{aggregate_id}/applied": "waitms"}
LONGEST_WAIT_MS = 2000


def _waits_long(value):
    try:
        return int(str(value).strip()) > LONGEST_WAIT_MS
    except ValueError:
        return False


def _is_one(value):
    try:
        return int(str(value).strip()) == 1
    except ValueError:
        return False


def _any(values, name, matches):
    return any(key.lower() == name and matches(value) for key, value in (values or {}).items())


@schemathesis.hook
def filter_case(ctx, case):
    """Never sends a request that switches on a control which holds or cuts later requests.

    Applied in every phase (the coverage phase runs no per-part filters).
    """
    path = case.operation.path
    if path in GATES:
        # POST /lab/*/gate/close: a closed gate holds later requests until it is opened.
        return str((case.path_parameters or {}).get("action")) != "close"
    if path in LONG_POLLS:
        # GET /v1/aggregates/{id}/applied?waitMs=30000 on an empty aggregate waits 30 s.
        return not _any(case.query, LONG_POLLS[path], _waits_long)
    if path == "/stream":
        # GET /stream?abortAfter=1 cuts the connection after the first line, on purpose.
        return not _any(case.query, "abortafter", _is_one)
    if path == "/documents/1":
        # PUT /documents/1 with X-Lab-Pause: true parks at the armed probe until a release.
        return not _any(case.headers, "x-lab-pause", lambda value: str(value).strip().lower() == "true")
    return True


@schemathesis.hook
def filter_failure(ctx, failure, case, response):
    """Drops only the server-error failure of a documented, deliberately switched-on 503."""
    if failure.code != "ST101" or response.status_code != 503:
        return True
    operation = (case.operation.method.upper(), case.operation.path)
    if operation in ALWAYS_FAILS:
        return False
    switch = FAULT_SWITCHES.get(operation)
    if switch is None:
        return True
    switched_on = any(
        name.lower() == switch and str(value).strip().lower() == "true"
        for name, value in (case.query or {}).items()
    )
    return not switched_on
