"""``gpushare inspect``: the command (:mod:`.cmd`), what it shows (:mod:`.model`) and its tables (:mod:`.render`)."""
