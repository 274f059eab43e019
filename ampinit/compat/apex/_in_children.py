"""``ampinit run``'s aliases in the processes its script starts with the "spawn" or "forkserver" start method.

Such a child is a fresh interpreter that re-imports the script (as ``__mp_main__``) and unpickles its target: an
``import apex`` there needs the aliases as much as in the parent (``python script.py`` children would find the same
modules as their parent). ``fork`` children inherit them. Importing this module installs the aliases: a
forkserver's server process preloads it, and its forked children inherit them; a spawned child's command line
imports it before ``spawn_main``.
"""

from ampinit.compat.apex._alias import install

install()
