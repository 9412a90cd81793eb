"""Write docs/config.md: every key of stabilize-train's config with its default, what it
allows and what it means, from the settings dataclasses (stabilize/run/keys.py, the table
``stabilize-train --keys`` prints).

    python scripts/config_doc.py [--check]

``--check`` writes nothing and exits 1 when the file is not what the source gives
(tests/test_config_keys.py checks the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stabilize.run.keys import markdown
from stabilize.train import key_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    a = p.parse_args()
    text = markdown(key_table())
    if a.check:
        current = DOC.read_text() if DOC.is_file() else ""
        if current != text:
            print(f"{DOC} is stale: run python scripts/config_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC} ({text.count(chr(10) + '| `')} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
