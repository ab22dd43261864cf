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
)
AUTOSTART: tuple[str, ...] = (
    "~/.config/tether", "~/.config/autostart", "~/.config/systemd/user", "~/.local/share/systemd/user",
    "~/.config/upstart", "~/.local/share/dbus-1/services", "~/.local/share/applications", "~/.config/mimeapps.list",
    "~/.mailcap", "~/.config/plasma-workspace", "~/.config/i3", "~/.config/sway", "~/.config/hypr",
    "~/.config/openbox", "~/.config/lxsession", "~/Library/LaunchAgents",
    "/var/spool/cron", "/var/spool/anacron", "/etc/crontab", "/etc/cron.d", "/etc/anacrontab",
)
PROGRAMS: tuple[str, ...] = (
    "~/.ssh", "~/.local/bin", "~/bin", "~/.cargo/bin", "~/go/bin", "~/.deno/bin", "~/.bun/bin", "~/.volta/bin",
    "~/.npm-global/bin", "~/.pyenv/shims", "~/.rbenv/shims",
)
LOADED_CODE: tuple[str, ...] = (
    "*.pth", "sitecustomize.py", "usercustomize.py", "~/.ipython", "~/.config/ipython",
    "~/.vimrc", "~/.gvimrc", "~/.vim", "~/.config/nvim", "~/.emacs", "~/.emacs.d", "~/.config/emacs",
    ".exrc", ".nvimrc", ".nvim.lua",
)
GIT: tuple[str, ...] = (
    ".git/hooks", ".git/config", ".git/config.worktree", ".git/worktrees/*/config.worktree",
    # a submodule's repository: its checkout's `.git` file points here, and git runs these like the above
    ".git/modules/**/config", ".git/modules/**/hooks", ".git/modules/**/config.worktree",
    "~/.gitconfig", "~/.config/git",
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
)
DIRENV: tuple[str, ...] = (".envrc", ".direnv", "~/.config/direnv")

DEFAULT_PROTECTED: tuple[str, ...] = (
    *SHELL_STARTUP, *AUTOSTART, *PROGRAMS, *LOADED_CODE, *GIT, *PACKAGE_MANAGERS, *AGENT_CONFIGS, *DIRENV,
)

__all__ = ["AGENT_CONFIGS", "AUTOSTART", "DEFAULT_PROTECTED", "DIRENV", "GIT", "LOADED_CODE", "PACKAGE_MANAGERS",
           "PROGRAMS", "SHELL_STARTUP"]
