"""Checks the admin API against its OpenAPI document with schemathesis (run by
tests/e2e/openapi.rs, under the virtualenv scripts/test makes from requirements.txt):

    python run.py ADMIN_URL TOKEN

First, that the JSON the gateway serves is docs/openapi.yaml (scripts/openapi writes one from
the other); then every operation, its examples and generated cases, and stateful sequences:
no 5xx, every answer's status, media type, headers and body as documented, and every secured
operation refusing a request without the token. Exits non-zero on any failure.
"""
import json
import pathlib
import subprocess
import sys
import urllib.request

import yaml

url, token = sys.argv[1], sys.argv[2]
root = pathlib.Path(__file__).resolve().parent.parent.parent
written = yaml.safe_load((root / "docs/openapi.yaml").read_text())
with urllib.request.urlopen(f"{url}/openapi.json") as answer:
    served = json.load(answer)
if served != written:
    sys.exit("the served /openapi.json is not docs/openapi.yaml: run scripts/openapi")

st = pathlib.Path(sys.executable).parent / "st"
checks = ",".join([
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "ignored_auth",
])
result = subprocess.run([
    str(st), "run", f"{url}/openapi.json",
    "--url", url,
    "--header", f"Authorization: Bearer {token}",
    "--checks", checks,
    "--mode", "positive",
    "--max-examples", "30",
    "--generation-deterministic",
    "--no-color",
])
sys.exit(result.returncode)
