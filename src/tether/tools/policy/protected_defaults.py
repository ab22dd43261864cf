"""The default protected paths: places whose content another program later runs or loads.

Pure data, grouped by class (docs/security/protected-paths.md explains each), in a module of its own
so that both the policy model (which checks `unprotect_paths` against it) and the rules that match
paths (`tether.tools.policy.path_rules`) can import it without importing each other.
"""

from __future__ import annotations

# Grouped by class; docs/security/protected-paths.md explains each.
SHELL_STARTUP: tuple[str, ...] = (
    "~/.profile", "~/.bashrc", "~/.bash_profile", "~/.bash_login", "~/.bash_logout", "~/.bash_aliases",
    "~/.bash_completion", "~/.local/share/bash-completion", "~/.zshrc", "~/.zshenv", "~/.zprofile", "~/.zlogin",
    "~/.zlogout", "~/.config/zsh", "~/.oh-my-zsh", "~/.config/fish", "~/.config/nushell", "~/.cshrc", "~/.tcshrc",
    "~/.login", "~/.kshrc", "~/.mkshrc", "~/.inputrc", "~/.pam_environment", "~/.config/environment.d",
    "~/.xprofile", "~/.xinitrc", "~/.xsession", "~/.xsessionrc", "~/.tmux.conf", "~/.config/tmux", "~/.screenrc",
    "~/.bashrc.d", "~/.p10k.zsh", "~/.xonshrc", "~/.config/xonsh", "~/.config/elvish", "~/.config/powershell",
    "~/.Xclients",
)
AUTOSTART: tuple[str, ...] = (
    "~/.config/tether", "~/.config/autostart", "~/.config/systemd/user", "~/.local/share/systemd/user",
    "~/.config/upstart", "~/.local/share/dbus-1/services", "~/.local/share/applications", "~/.config/mimeapps.list",
    "~/.mailcap", "~/.config/plasma-workspace", "~/.config/i3", "~/.config/sway", "~/.config/hypr",
    "~/.config/openbox", "~/.config/lxsession", "~/Library/LaunchAgents",
    "/var/spool/cron", "/var/spool/anacron", "/etc/crontab", "/etc/cron.d", "/etc/anacrontab",
)
# desktop sessions: what a desktop shell, file manager or window manager loads or runs at log-in or on a click
DESKTOP: tuple[str, ...] = (
    "~/.config/autostart-scripts", "~/.kde/Autostart", "~/.kde4/Autostart", "~/.local/share/gnome-shell/extensions",
    "~/.local/share/nautilus/scripts", "~/.local/share/nautilus-python", "~/.local/share/kio/servicemenus",
    "~/.local/share/kservices5", "~/.config/awesome", "~/.config/bspwm", "~/.config/sxhkd", "~/.config/qtile",
    "~/.config/river", "~/.config/labwc", "~/.config/herbstluftwm", "~/.xmonad", "~/.config/xmonad",
    "~/.config/niri", "~/.config/wayfire.ini", "~/.config/leftwm", "~/.fluxbox",
)
# terminals and prompts: run a shell or commands each time a terminal opens or a prompt is drawn
TERMINALS: tuple[str, ...] = (
    "~/.config/starship.toml", "~/.config/alacritty", "~/.alacritty.toml", "~/.alacritty.yml", "~/.config/kitty",
    "~/.wezterm.lua", "~/.config/wezterm", "~/.config/ghostty", "~/.config/foot", "~/.config/terminator",
)
PROGRAMS: tuple[str, ...] = (
    "~/.ssh", "~/.local/bin", "~/bin", "~/.cargo/bin", "~/go/bin", "~/.deno/bin", "~/.bun/bin", "~/.volta/bin",
    "~/.npm-global/bin", "~/.pyenv/shims", "~/.rbenv/shims",
)
LOADED_CODE: tuple[str, ...] = (
    "*.pth", "sitecustomize.py", "usercustomize.py", "~/.ipython", "~/.config/ipython",
    # the user's site-packages: on every Python's path ahead of the system's packages, so a module there
    # shadows one a system tool imports (command-not-found runs on every mistyped command)
    "~/.local/lib/python*/site-packages",
    "~/.vimrc", "~/.gvimrc", "~/.vim", "~/.config/nvim", "~/.emacs", "~/.emacs.d", "~/.config/emacs",
    ".exrc", ".nvimrc", ".nvim.lua",
    # debuggers' and interpreters' start-up files (R, ghci and pry read one in the current directory too)
    "~/.gdbinit", "~/.config/gdb", "~/.lldbinit", ".Rprofile", "~/.julia/config", "~/.irbrc", "~/.pryrc", ".pryrc",
    ".ghci", "~/.psqlrc", "~/.sqliterc", "~/.octaverc",
    # editors' plug-ins and extensions, loaded when the editor starts
    "~/.vscode/extensions", "~/.vscode-server", "~/.vscode-oss", "~/.local/share/nvim/site", "~/.local/share/nvim/lazy",
    "~/.config/sublime-text/Packages", "~/.local/share/JetBrains",
    # mail readers whose configuration runs commands
    "~/.muttrc", "~/.mutt", "~/.config/mutt",
)
GIT: tuple[str, ...] = (
    ".git/hooks", ".git/config", ".git/config.worktree", ".git/worktrees/*/config.worktree",
    # a submodule's repository: its checkout's `.git` file points here, and git runs these like the above
    ".git/modules/**/config", ".git/modules/**/hooks", ".git/modules/**/config.worktree",
    "~/.gitconfig", "~/.config/git",
)
# other version control systems' repository and user configs (hooks), and hooks that live in the work tree
# (a hook manager's `core.hooksPath`, or the config its installed hook reads at every commit)
OTHER_HOOKS: tuple[str, ...] = (
    ".hg/hgrc", "~/.hgrc", "~/.config/hg", ".husky", ".githooks", ".pre-commit-config.yaml", "lefthook.yml",
    "lefthook.yaml", ".lefthook.yml", ".lefthook.yaml", "lefthook-local.yml", "lefthook-local.yaml",
)
PACKAGE_MANAGERS: tuple[str, ...] = (
    ".npmrc", ".yarnrc", ".yarnrc.yml", ".pnpmfile.cjs", "pip.conf", "pip.ini", ".pypirc", "~/.config/pip",
    "~/.pip", "~/.pydistutils.cfg", "~/.config/uv", ".cargo/config", ".cargo/config.toml", "~/.gemrc",
    ".bundle/config", "~/.m2/settings.xml", "~/.gradle/init.d", "~/.gradle/init.gradle", "~/.condarc",
)
AGENT_CONFIGS: tuple[str, ...] = (
    "claude_desktop_config.json", ".mcp.json", ".cursor/mcp.json", ".vscode/mcp.json", ".vscode/tasks.json",
    ".vscode/settings.json", ".claude/settings.json", ".claude/settings.local.json", "~/.claude.json",
    "~/.claude", "~/.codex", "~/.cursor", "~/.gemini", ".gemini/settings.json", "~/.continue",
    "~/.codeium", "~/.config/Code/User", "~/.config/zed",
    # a dev container's initializeCommand runs on the host when the folder is opened in its container
    ".devcontainer/devcontainer.json", ".devcontainer.json",
)
DIRENV: tuple[str, ...] = (".envrc", ".direnv", "~/.config/direnv")
# a tether server's own database wherever its state directory is (`server.db` there): its rows are the API tokens,
# the audit log and the tasks, so a command that writes it on the server's machine could mint itself a person's
# token (live at the server's next start) or roll the audit back; its lock files say which server owns it
TETHER_SERVER: tuple[str, ...] = (
    "server.db", "server.db-wal", "server.db-shm", "server.db-journal", "server.db.lock", "server.db.node-*.lock",
)

DEFAULT_PROTECTED: tuple[str, ...] = (
    *SHELL_STARTUP, *AUTOSTART, *DESKTOP, *TERMINALS, *PROGRAMS, *LOADED_CODE, *GIT, *OTHER_HOOKS, *PACKAGE_MANAGERS,
    *AGENT_CONFIGS, *DIRENV, *TETHER_SERVER,
)

__all__ = ["AGENT_CONFIGS", "AUTOSTART", "DEFAULT_PROTECTED", "DESKTOP", "DIRENV", "GIT", "LOADED_CODE", "OTHER_HOOKS",
           "PACKAGE_MANAGERS", "PROGRAMS", "SHELL_STARTUP", "TERMINALS", "TETHER_SERVER"]
