"""Started by Python in the child processes of tests that put this folder first on PYTHONPATH:
`MESHTRAIN_TEST_POISON=first:end` poisons the train rows [first, end) (`tests.planted_rows.plant`)."""

import os

if os.environ.get("MESHTRAIN_TEST_POISON"):
    from tests.planted_rows import plant

    plant(*(int(x) for x in os.environ["MESHTRAIN_TEST_POISON"].split(":")))
