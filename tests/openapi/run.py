"""Checks the admin API against its OpenAPI document with schemathesis (run by
tests/e2e/openapi.rs, under the virtualenv scripts/test makes from requirements.txt):

    python run.py ADMIN_URL TOKEN ID...

(IDs: records the store holds, drawn for `{id}`; run in a scratch directory, where it writes
its schemathesis.toml.)

First, that the JSON the gateway serves is docs/openapi.yaml (scripts/openapi writes one from
the other); then every operation, its examples and generated cases (valid and invalid), and
stateful sequences, with every check schemathesis has: no 5xx, every answer's status, media
type, headers and body as documented, valid requests accepted and invalid ones refused,
methods a path does not answer refused with `Allow`, a released record gone, and every secured
operation refusing a request without the token. Exits non-zero on any failure or warning.
"""
import json
import pathlib
import subprocess
import sys
import urllib.request

import yaml

url, token, ids = sys.argv[1], sys.argv[2], sys.argv[3:]
root = pathlib.Path(__file__).resolve().parent.parent.parent
written = yaml.safe_load((root / "docs/openapi.yaml").read_text())
with urllib.request.urlopen(f"{url}/openapi.json") as answer:
    served = json.load(answer)
if served != written:
    sys.exit("the served /openapi.json is not docs/openapi.yaml: run scripts/openapi")

# Known records' ids are drawn half the time for {id} (the other half is generated): without
# them nearly every case would meet "no record". A listing's cursor is opaque: one the store
# did not hand out is refused (400) however well-formed it looks. Any warning (an operation
# without test data, a link that never resolves, ...) fails the run.
config = f"""
[warnings]
fail-on = true

[dictionaries.ids]
values = {json.dumps(ids)}

[parameters]
"path.id" = {{ dictionary = "ids", probability = 0.5 }}

[[operations]]
include-operation-id = "listUnknown"
checks.positive_data_acceptance.expected-statuses = ["2xx", 400]
"""
pathlib.Path("schemathesis.toml").write_text(config)

st = pathlib.Path(sys.executable).parent / "st"
result = subprocess.run([
    str(st), "run", f"{url}/openapi.json",
    "--url", url,
    "--header", f"Authorization: Bearer {token}",
    "--checks", "all",
    "--max-examples", "30",
    "--generation-deterministic",
    "--no-color",
])
sys.exit(result.returncode)
