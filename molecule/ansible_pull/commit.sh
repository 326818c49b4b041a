#!/bin/sh
# commit.sh DIR REVISION signed|unsigned: commit local.yml for REVISION in DIR/work and push it to
# DIR/origin.git's main, signed with DIR/signer (git's SSH signatures) or not; prints the commit id.
set -eu
dir=$1 revision=$2 mode=$3
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
export GIT_AUTHOR_NAME=Signer GIT_AUTHOR_EMAIL=signer@example.test
export GIT_COMMITTER_NAME=Signer GIT_COMMITTER_EMAIL=signer@example.test
if [ ! -d "$dir/origin.git" ]; then
  git init --quiet --bare --initial-branch=main "$dir/origin.git"
  git clone --quiet "$dir/origin.git" "$dir/work" 2>/dev/null
  git -C "$dir/work" checkout --quiet -B main
fi
cat > "$dir/work/local.yml" <<PLAY
- name: Converge from the pull repo
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Record the applied commit
      ansible.builtin.copy:
        dest: /var/lib/pull-marker
        content: "{{ meridian_pull_commit }} $revision\n"
        mode: "0644"
PLAY
git -C "$dir/work" add local.yml
trailer="Meridian-Pull-Target: $dir/origin main"
if [ "$mode" = signed ]; then
  git -C "$dir/work" -c gpg.format=ssh -c user.signingkey="$dir/signer" commit --quiet -S -m "$revision" -m "$trailer"
else
  git -C "$dir/work" commit --quiet --no-gpg-sign -m "$revision" -m "$trailer"
fi
git -C "$dir/work" push --quiet origin HEAD:refs/heads/main
git -C "$dir/work" rev-parse HEAD
