// helm-render renders a Helm chart the way `helm template` does, with Helm's
// own template engine: Go's text/template, the sprig function library and
// Helm's extra functions (include, tpl, required, toYaml, fromYaml,
// fromYamlArray, toJson, fromJson, fromJsonArray, lookup), and Helm's
// built-in objects (.Values, .Release, .Chart, .Capabilities, .Files,
// .Template). Helm itself is not packaged in Debian; Go 1.19 and sprig are,
// and this is the part of Helm a chart's correctness depends on.
//
//	helm-render [--namespace NS] [-f values.yaml]... [--set k=v]...
//	            [--set-string k=v]... [--api-versions group/version]... NAME CHART_DIR
//
// What it mirrors from Helm 3 (pkg/engine, pkg/chartutil, pkg/strvals):
//   - every file under templates/ is parsed into one template set, in Helm's
//     order (shallower paths first, then by name), named
//     "<chart>/templates/<file>"; files whose base name starts with "_" are
//     partials (parsed, never rendered); NOTES.txt is rendered (so its errors
//     show) but not printed;
//   - missingkey=zero, and "<no value>" is removed from the output;
//   - values: values.yaml, then each -f file, then --set/--set-string, merged
//     as Helm does (a user's null deletes a chart default);
//   - YAML goes through JSON as in sigs.k8s.io/yaml (here its ancestor
//     github.com/ghodss/yaml, same behaviour): numbers in values are float64;
//   - lookup returns an empty map (what `helm template` gives without a cluster);
//   - the output is `helm template`'s: each document as "---\n# Source: FILE\n...".
//
// Not supported (an error, never a silent difference): chart dependencies
// (charts/, Chart.yaml dependencies), values.schema.json, toToml.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig" // Debian's GOPATH layout: sprig v3 without /v3
	"github.com/ghodss/yaml"
)

// Metadata is Chart.yaml, with the field names templates use (.Chart.Name,
// .Chart.AppVersion...), as helm.sh/helm/v3/pkg/chart.Metadata.
type Metadata struct {
	Name         string            `json:"name,omitempty"`
	Home         string            `json:"home,omitempty"`
	Sources      []string          `json:"sources,omitempty"`
	Version      string            `json:"version,omitempty"`
	Description  string            `json:"description,omitempty"`
	Keywords     []string          `json:"keywords,omitempty"`
	Maintainers  []interface{}     `json:"maintainers,omitempty"`
	Icon         string            `json:"icon,omitempty"`
	APIVersion   string            `json:"apiVersion,omitempty"`
	Condition    string            `json:"condition,omitempty"`
	Tags         string            `json:"tags,omitempty"`
	AppVersion   string            `json:"appVersion,omitempty"`
	Deprecated   bool              `json:"deprecated,omitempty"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	KubeVersion  string            `json:"kubeVersion,omitempty"`
	Dependencies []interface{}     `json:"dependencies,omitempty"`
	Type         string            `json:"type,omitempty"`
}

// VersionSet is .Capabilities.APIVersions.
type VersionSet []string

// Has says whether the API version (or "group/version/Kind") is known.
func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

// KubeVersion is .Capabilities.KubeVersion.
type KubeVersion struct {
	Version string
	Major   string
	Minor   string
}

// String is what `{{ .Capabilities.KubeVersion }}` prints.
func (k KubeVersion) String() string { return k.Version }

// GitVersion is the deprecated alias Helm keeps.
func (k KubeVersion) GitVersion() string { return k.Version }

// Capabilities is .Capabilities.
type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
	HelmVersion map[string]string
}

// defaultAPIVersions: the built-in API versions of the Kubernetes release the
// tests run (1.20), as `helm template` assumes without --api-versions.
var defaultAPIVersions = []string{
	"v1", "admissionregistration.k8s.io/v1", "apiextensions.k8s.io/v1",
	"apps/v1", "authentication.k8s.io/v1", "authorization.k8s.io/v1",
	"autoscaling/v1", "autoscaling/v2beta2", "batch/v1", "batch/v1beta1",
	"certificates.k8s.io/v1", "coordination.k8s.io/v1", "discovery.k8s.io/v1beta1",
	"events.k8s.io/v1", "networking.k8s.io/v1", "node.k8s.io/v1",
	"policy/v1beta1", "rbac.authorization.k8s.io/v1", "scheduling.k8s.io/v1",
	"storage.k8s.io/v1",
}

// Files is .Files: the chart's files outside templates/.
type Files map[string][]byte

// Get returns a file's text ("" when absent), as Helm's .Files.Get.
func (f Files) Get(name string) string { return string(f[name]) }

// GetBytes returns a file's bytes (nil when absent).
func (f Files) GetBytes(name string) []byte { return f[name] }

// Lines returns a file's lines.
func (f Files) Lines(name string) []string {
	if f[name] == nil {
		return []string{}
	}
	return strings.Split(string(f[name]), "\n")
}

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "helm-render: %v\n", err)
		os.Exit(1)
	}
}

var releaseName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)

func run(args []string) error {
	fs := flag.NewFlagSet("helm-render", flag.ContinueOnError)
	var namespace string
	var valueFiles, sets, setStrings, apiVersions listFlag
	var isUpgrade bool
	fs.StringVar(&namespace, "namespace", "default", "the release namespace")
	fs.StringVar(&namespace, "n", "default", "the release namespace (short)")
	fs.Var(&valueFiles, "values", "a values file (repeatable)")
	fs.Var(&valueFiles, "f", "a values file (short, repeatable)")
	fs.Var(&sets, "set", "key=value[,key=value] (repeatable)")
	fs.Var(&setStrings, "set-string", "key=value, values kept as strings (repeatable)")
	fs.Var(&apiVersions, "api-versions", "an API version for .Capabilities.APIVersions (repeatable)")
	fs.BoolVar(&isUpgrade, "is-upgrade", false, ".Release.IsUpgrade (and not .IsInstall)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 2 {
		return errors.New("usage: helm-render [flags] NAME CHART_DIR")
	}
	name, dir := fs.Arg(0), fs.Arg(1)
	// Helm's release name rule (pkg/chartutil.ValidateReleaseName).
	if len(name) > 53 || !releaseName.MatchString(name) {
		return fmt.Errorf("release name %q: must be a DNS-1123 name of at most 53 characters", name)
	}

	meta, err := loadMetadata(dir)
	if err != nil {
		return err
	}
	defaults, err := readValuesFile(filepath.Join(dir, "values.yaml"), true)
	if err != nil {
		return err
	}
	user := map[string]interface{}{}
	for _, f := range valueFiles {
		v, err := readValuesFile(f, false)
		if err != nil {
			return err
		}
		user = mergeMaps(user, v)
	}
	for _, s := range sets {
		if err := parseSet(s, user, false); err != nil {
			return fmt.Errorf("--set %s: %w", s, err)
		}
	}
	for _, s := range setStrings {
		if err := parseSet(s, user, true); err != nil {
			return fmt.Errorf("--set-string %s: %w", s, err)
		}
	}
	values := coalesceTables(user, defaults)

	templates, files, err := loadChartFiles(dir, meta.Name)
	if err != nil {
		return err
	}
	top := map[string]interface{}{
		"Chart": meta,
		"Release": map[string]interface{}{
			"Name":      name,
			"Namespace": namespace,
			"IsUpgrade": isUpgrade,
			"IsInstall": !isUpgrade,
			"Revision":  1,
			"Service":   "Helm",
		},
		"Capabilities": Capabilities{
			KubeVersion: KubeVersion{Version: "v1.20.2", Major: "1", Minor: "20"},
			APIVersions: append(VersionSet(append([]string{}, defaultAPIVersions...)), apiVersions...),
			HelmVersion: map[string]string{"version": "v3 (helm-render)"},
		},
		"Values": values,
		"Files":  files,
	}
	rendered, err := render(templates, top)
	if err != nil {
		return err
	}
	return write(os.Stdout, rendered)
}

func loadMetadata(dir string) (*Metadata, error) {
	file := filepath.Join(dir, "Chart.yaml")
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var m Metadata
	if err := yaml.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if m.Name == "" || m.Version == "" {
		return nil, fmt.Errorf("%s: name and version are required", file)
	}
	if len(m.Dependencies) > 0 {
		return nil, fmt.Errorf("%s: chart dependencies are not supported", file)
	}
	if _, err := os.Stat(filepath.Join(dir, "charts")); err == nil {
		return nil, fmt.Errorf("%s: subcharts (charts/) are not supported", dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "values.schema.json")); err == nil {
		return nil, fmt.Errorf("%s: values.schema.json is not supported", dir)
	}
	return &m, nil
}

// readValuesFile parses a values file as Helm's chartutil.ReadValues does.
func readValuesFile(file string, optional bool) (map[string]interface{}, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		if optional && os.IsNotExist(err) {
			return map[string]interface{}{}, nil
		}
		return nil, err
	}
	v := map[string]interface{}{}
	if err := yaml.Unmarshal(data, &v); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	if v == nil {
		v = map[string]interface{}{}
	}
	return v, nil
}

// loadChartFiles reads templates/ (name -> text, Helm's template names) and
// every other file for .Files.
func loadChartFiles(dir, chart string) (map[string]string, Files, error) {
	templates := map[string]string{}
	files := Files{}
	err := filepath.Walk(dir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if info.IsDir() {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(rel, "templates/"):
			templates[path.Join(chart, rel)] = string(data)
		case rel == "Chart.yaml" || rel == "values.yaml":
		default:
			files[rel] = data
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	if len(templates) == 0 {
		return nil, nil, fmt.Errorf("%s: no templates/", dir)
	}
	return templates, files, nil
}

// ------------------------------------------------------------ values ---

// mergeMaps is Helm's cli/values mergeMaps: b over a, maps merged deeply.
func mergeMaps(a, b map[string]interface{}) map[string]interface{} {
	out := make(map[string]interface{}, len(a))
	for k, v := range a {
		out[k] = v
	}
	for k, v := range b {
		if vm, ok := v.(map[string]interface{}); ok {
			if bv, ok := out[k]; ok {
				if bm, ok := bv.(map[string]interface{}); ok {
					out[k] = mergeMaps(bm, vm)
					continue
				}
			}
		}
		out[k] = v
	}
	return out
}

// coalesceTables is Helm's chartutil coalesce for the root chart: the user's
// values win, tables are merged, and a user's null removes the default.
func coalesceTables(dst, src map[string]interface{}) map[string]interface{} {
	if dst == nil {
		dst = map[string]interface{}{}
	}
	for k, v := range src {
		dv, set := dst[k]
		switch {
		case set && dv == nil:
			delete(dst, k)
		case !set:
			dst[k] = copyValue(v)
		default:
			dm, dok := dv.(map[string]interface{})
			sm, sok := v.(map[string]interface{})
			if dok && sok {
				dst[k] = coalesceTables(dm, sm)
			} else if sok && !dok {
				fmt.Fprintf(os.Stderr, "helm-render: warning: %s: a table is overridden by %v\n", k, dv)
			}
		}
	}
	// A null the user gave for a key the chart does not have is dropped too.
	for k, v := range dst {
		if v == nil {
			delete(dst, k)
		}
	}
	return dst
}

func copyValue(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		m := make(map[string]interface{}, len(t))
		for k, x := range t {
			m[k] = copyValue(x)
		}
		return m
	case []interface{}:
		l := make([]interface{}, len(t))
		for i, x := range t {
			l[i] = copyValue(x)
		}
		return l
	default:
		return v
	}
}

// parseSet applies one --set argument (Helm's strvals grammar: a.b=v,
// a\.b=v, list[0]=v, a={x,y}, several separated by ","), typing values as
// strvals does unless asString.
func parseSet(s string, dest map[string]interface{}, asString bool) error {
	p := &setParser{in: []rune(s), asString: asString}
	for !p.eof() {
		if err := p.assignment(dest); err != nil {
			return err
		}
		if !p.eof() {
			if p.in[p.pos] != ',' {
				return fmt.Errorf("unexpected %q at %d", p.in[p.pos], p.pos)
			}
			p.pos++
		}
	}
	return nil
}

type setParser struct {
	in       []rune
	pos      int
	asString bool
}

func (p *setParser) eof() bool { return p.pos >= len(p.in) }

// key reads up to one of stops (not consumed); a backslash escapes.
func (p *setParser) key(stops string) (string, rune) {
	var b strings.Builder
	for !p.eof() {
		c := p.in[p.pos]
		if c == '\\' && p.pos+1 < len(p.in) {
			b.WriteRune(p.in[p.pos+1])
			p.pos += 2
			continue
		}
		if strings.ContainsRune(stops, c) {
			return b.String(), c
		}
		b.WriteRune(c)
		p.pos++
	}
	return b.String(), 0
}

func (p *setParser) assignment(dest map[string]interface{}) error {
	k, stop := p.key("=.[,")
	if k == "" {
		return errors.New("empty key")
	}
	switch stop {
	case '=':
		p.pos++
		v, err := p.value()
		if err != nil {
			return err
		}
		dest[k] = v
		return nil
	case '.':
		p.pos++
		inner, ok := dest[k].(map[string]interface{})
		if !ok {
			inner = map[string]interface{}{}
			dest[k] = inner
		}
		return p.assignment(inner)
	case '[':
		list, _ := dest[k].([]interface{})
		list, err := p.indexed(list)
		if err != nil {
			return err
		}
		dest[k] = list
		return nil
	default:
		return fmt.Errorf("key %q has no value", k)
	}
}

// indexed handles "[N]..." after a list key, returning the updated list.
func (p *setParser) indexed(list []interface{}) ([]interface{}, error) {
	p.pos++ // '['
	num, stop := p.key("]")
	if stop != ']' {
		return nil, errors.New("unclosed [")
	}
	p.pos++
	i, err := strconv.Atoi(num)
	if err != nil || i < 0 {
		return nil, fmt.Errorf("bad list index %q", num)
	}
	for len(list) <= i {
		list = append(list, nil)
	}
	if p.eof() {
		return nil, errors.New("list element has no value")
	}
	switch p.in[p.pos] {
	case '=':
		p.pos++
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		list[i] = v
	case '.':
		p.pos++
		inner, ok := list[i].(map[string]interface{})
		if !ok {
			inner = map[string]interface{}{}
			list[i] = inner
		}
		if err := p.assignment(inner); err != nil {
			return nil, err
		}
	case '[':
		inner, _ := list[i].([]interface{})
		inner, err := p.indexed(inner)
		if err != nil {
			return nil, err
		}
		list[i] = inner
	default:
		return nil, fmt.Errorf("unexpected %q after ]", p.in[p.pos])
	}
	return list, nil
}

func (p *setParser) value() (interface{}, error) {
	if !p.eof() && p.in[p.pos] == '{' {
		p.pos++
		list := []interface{}{}
		for {
			v, stop := p.key(",}")
			if stop == 0 {
				return nil, errors.New("unclosed {")
			}
			p.pos++
			if v != "" || stop == ',' {
				list = append(list, typedVal(v, p.asString))
			}
			if stop == '}' {
				return list, nil
			}
		}
	}
	v, _ := p.key(",")
	return typedVal(v, p.asString), nil
}

// typedVal is strvals.typedVal.
func typedVal(s string, asString bool) interface{} {
	if asString {
		return s
	}
	switch {
	case strings.EqualFold(s, "true"):
		return true
	case strings.EqualFold(s, "false"):
		return false
	case strings.EqualFold(s, "null"):
		return nil
	case s == "0":
		return int64(0)
	}
	if s != "" && s[0] != '0' {
		if i, err := strconv.ParseInt(s, 10, 64); err == nil {
			return i
		}
	}
	return s
}

// ------------------------------------------------------------ engine ---

// funcMap is Helm's: sprig's text functions without env/expandenv, plus
// Helm's; include, tpl and required are bound in render.
func funcMap() template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env")
	delete(f, "expandenv")
	f["toYaml"] = func(v interface{}) string {
		data, err := yaml.Marshal(v)
		if err != nil {
			return ""
		}
		return strings.TrimSuffix(string(data), "\n")
	}
	f["fromYaml"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := yaml.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	f["fromYamlArray"] = func(s string) []interface{} {
		a := []interface{}{}
		if err := yaml.Unmarshal([]byte(s), &a); err != nil {
			a = []interface{}{err.Error()}
		}
		return a
	}
	f["toJson"] = func(v interface{}) string {
		data, err := json.Marshal(v)
		if err != nil {
			return ""
		}
		return string(data)
	}
	f["fromJson"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	f["fromJsonArray"] = func(s string) []interface{} {
		a := []interface{}{}
		if err := json.Unmarshal([]byte(s), &a); err != nil {
			a = []interface{}{err.Error()}
		}
		return a
	}
	// `helm template` has no cluster: lookup finds nothing.
	f["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	return f
}

const warnStart, warnEnd = "HELM_ERR_START", "HELM_ERR_END"

var warnRegex = regexp.MustCompile(warnStart + `(.*)` + warnEnd)

// sortTemplates is Helm's parse order (byPathLen, reversed): deeper paths
// first, then names in reverse, so that of two templates defining one name,
// the shallower, earlier-named file's definition is parsed last and wins.
func sortTemplates(names []string) {
	sort.Slice(names, func(i, j int) bool {
		a, b := names[i], names[j]
		ca, cb := strings.Count(a, "/"), strings.Count(b, "/")
		if ca != cb {
			return ca > cb
		}
		return a > b
	})
}

func render(templates map[string]string, top map[string]interface{}) (map[string]string, error) {
	t := template.New("gotpl").Option("missingkey=zero")
	includes := map[string]int{}
	funcs := funcMap()
	funcs["include"] = func(name string, data interface{}) (string, error) {
		if includes[name] > 1000 {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		includes[name]++
		defer func() { includes[name]-- }()
		var buf strings.Builder
		err := t.ExecuteTemplate(&buf, name, data)
		return buf.String(), err
	}
	funcs["required"] = func(warn string, val interface{}) (interface{}, error) {
		if val == nil {
			return val, errors.New(warnStart + warn + warnEnd)
		}
		if s, ok := val.(string); ok && s == "" {
			return val, errors.New(warnStart + warn + warnEnd)
		}
		return val, nil
	}
	funcs["tpl"] = func(text string, vals interface{}) (string, error) {
		clone, err := t.Clone()
		if err != nil {
			return "", err
		}
		name := "tpl"
		if m, ok := vals.(map[string]interface{}); ok {
			if tm, ok := m["Template"].(map[string]interface{}); ok {
				if n, ok := tm["Name"].(string); ok {
					name = n
				}
			}
		}
		if _, err := clone.New(name).Parse(text); err != nil {
			return "", fmt.Errorf("error during tpl function execution for %q: %w", text, err)
		}
		var buf strings.Builder
		if err := clone.ExecuteTemplate(&buf, name, vals); err != nil {
			return "", fmt.Errorf("error during tpl function execution for %q: %w", text, err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
	t.Funcs(funcs)

	names := make([]string, 0, len(templates))
	for n := range templates {
		names = append(names, n)
	}
	sortTemplates(names)
	for _, n := range names {
		if _, err := t.New(n).Parse(templates[n]); err != nil {
			return nil, fmt.Errorf("parse error in %s: %w", n, err)
		}
	}
	out := map[string]string{}
	for _, n := range names {
		if strings.HasPrefix(path.Base(n), "_") {
			continue
		}
		vals := make(map[string]interface{}, len(top)+1)
		for k, v := range top {
			vals[k] = v
		}
		// Every name is "<chart>/templates/...": BasePath is "<chart>/templates".
		base := n[:strings.Index(n, "/templates/")] + "/templates"
		vals["Template"] = map[string]interface{}{"Name": n, "BasePath": base}
		var buf strings.Builder
		if err := t.ExecuteTemplate(&buf, n, vals); err != nil {
			if m := warnRegex.FindStringSubmatch(err.Error()); len(m) == 2 {
				return nil, fmt.Errorf("execution error in %s: %s", n, m[1])
			}
			return nil, fmt.Errorf("execution error in %s: %w", n, err)
		}
		out[n] = strings.ReplaceAll(buf.String(), "<no value>", "")
	}
	return out, nil
}

// sep is releaseutil.SplitManifests' separator.
var sep = regexp.MustCompile("(?:^|\\s*\n)---\\s*")

// write prints the manifests as `helm template` does (each document trimmed,
// after "---" and a "# Source:" line), in file name order where Helm sorts
// by kind: NOTES.txt and documents holding only whitespace are left out.
func write(w *os.File, rendered map[string]string) error {
	names := make([]string, 0, len(rendered))
	for n := range rendered {
		if strings.HasSuffix(n, "NOTES.txt") {
			continue
		}
		names = append(names, n)
	}
	sort.Strings(names)
	var b bytes.Buffer
	for _, n := range names {
		for _, doc := range sep.Split(rendered[n], -1) {
			if strings.TrimSpace(doc) == "" {
				continue
			}
			fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", n, strings.TrimSpace(doc))
		}
	}
	_, err := w.Write(b.Bytes())
	return err
}
