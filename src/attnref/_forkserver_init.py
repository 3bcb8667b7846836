"""Imported first by the workers' forkserver, and by nothing else (`attnref._forkserver`):
the forkserver ends when the judge that started it ends (`die_with_parent`). The judge
never imports this module: it would then end with whatever started it."""

from attnref._dies_with_parent import die_with_parent

die_with_parent()
