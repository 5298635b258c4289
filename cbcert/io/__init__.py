"""Reading and writing models: the one checkpoint format (``checkpoint``) and the kind registry
(``registry``). Nothing here imports torch or ``cbcert.convert``."""
