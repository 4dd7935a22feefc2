package promtest

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strings"
)

// Dashboard is what the tests read of a Grafana dashboard's JSON model.
type Dashboard struct {
	UID           string `json:"uid"`
	Title         string `json:"title"`
	SchemaVersion int    `json:"schemaVersion"`
	Templating    struct {
		List []Variable `json:"list"`
	} `json:"templating"`
	Panels []Panel `json:"panels"`
}

// Datasource is a panel's, a target's or a variable's data source.
type Datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

// Variable is one of the dashboard's template variables.
type Variable struct {
	Name       string          `json:"name"`
	Type       string          `json:"type"`
	Datasource *Datasource     `json:"datasource"`
	Query      json.RawMessage `json:"query"` // a string, or {"query": ...} in newer models
	Definition string          `json:"definition"`
	IncludeAll bool            `json:"includeAll"`
	AllValue   string          `json:"allValue"`
	Multi      bool            `json:"multi"`
}

// Panel is a panel, or a row (Type "row") whose Panels are set when it is
// collapsed.
type Panel struct {
	ID         int         `json:"id"`
	Type       string      `json:"type"`
	Title      string      `json:"title"`
	Datasource *Datasource `json:"datasource"`
	Targets    []Target    `json:"targets"`
	Panels     []Panel     `json:"panels"`
	GridPos    *struct {
		H, W, X, Y int
	} `json:"gridPos"`
}

// Target is one query of a panel.
type Target struct {
	RefID      string      `json:"refId"`
	Datasource *Datasource `json:"datasource"`
	Expr       string      `json:"expr"`
}

// ReadDashboard reads a dashboard's JSON model, strictly: a field the
// model does not have is fine (Grafana's models carry many), but the file
// must be one JSON object.
func ReadDashboard(path string) (*Dashboard, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read dashboard: %w", err)
	}
	var d Dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		return nil, fmt.Errorf("dashboard %s: %w", path, err)
	}
	return &d, nil
}

// AllPanels is every panel of the dashboard, rows and the panels of
// collapsed rows included, in order.
func (d *Dashboard) AllPanels() []Panel {
	var out []Panel
	var walk func([]Panel)
	walk = func(ps []Panel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

// QueryText is a variable's query, from either shape of the model.
func (v Variable) QueryText() (string, error) {
	if len(v.Query) == 0 {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(v.Query, &s); err == nil {
		return s, nil
	}
	var o struct {
		Query string `json:"query"`
	}
	if err := json.Unmarshal(v.Query, &o); err != nil {
		return "", fmt.Errorf("variable %s: query is neither a string nor an object with one: %w", v.Name, err)
	}
	return o.Query, nil
}

var labelValuesCall = regexp.MustCompile(`^\s*label_values\(\s*(.+?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$`)

// LabelValuesQuery splits a variable's label_values(selector, label) into
// its series selector and label; ok is false for any other query.
func LabelValuesQuery(q string) (selector, label string, ok bool) {
	m := labelValuesCall.FindStringSubmatch(q)
	if m == nil {
		return "", "", false
	}
	return m[1], m[2], true
}

// TestVars are the values a test gives a dashboard's variables: each of
// Grafana's interval variables is window, each of the dashboard's own
// query variables its "All" value (its allValue; .* without one), the
// datasource variable its name.
func (d *Dashboard) TestVars(window string) map[string]string {
	vars := map[string]string{
		"__rate_interval": window,
		"__interval":      window,
		"__range":         window,
	}
	for _, v := range d.Templating.List {
		switch {
		case v.Type == "datasource":
			vars[v.Name] = v.Name
		case v.AllValue != "":
			vars[v.Name] = v.AllValue
		default:
			vars[v.Name] = ".*"
		}
	}
	return vars
}

// grafanaVar is a variable reference as Grafana writes it: ${name},
// ${name:format}, [[name]] or $name.
var grafanaVar = regexp.MustCompile(`\$\{([A-Za-z0-9_]+)(?::[^}]*)?\}|\[\[([A-Za-z0-9_]+)(?::[^\]]*)?\]\]|\$([A-Za-z0-9_]+)`)

// Substitute replaces the Grafana variables in a query with vars' values;
// a variable vars lacks is an error.
func Substitute(expr string, vars map[string]string) (string, error) {
	var errs []error
	out := grafanaVar.ReplaceAllStringFunc(expr, func(ref string) string {
		m := grafanaVar.FindStringSubmatch(ref)
		name := m[1] + m[2] + m[3]
		v, ok := vars[name]
		if !ok {
			errs = append(errs, fmt.Errorf("variable %s has no value", ref))
			return ref
		}
		return v
	})
	return out, errors.Join(errs...)
}

// Query is one target of one panel, its variables substituted.
type Query struct {
	Panel, RefID string
	Expr         string
}

func (q Query) String() string {
	return fmt.Sprintf("panel %q target %s: %s", q.Panel, q.RefID, q.Expr)
}

// Queries is every panel target's expression with vars substituted, in
// the dashboard's order.
func (d *Dashboard) Queries(vars map[string]string) ([]Query, error) {
	var out []Query
	var errs []error
	for _, p := range d.AllPanels() {
		for _, tg := range p.Targets {
			expr, err := Substitute(tg.Expr, vars)
			if err != nil {
				errs = append(errs, fmt.Errorf("panel %q target %s: %w", p.Title, tg.RefID, err))
				continue
			}
			out = append(out, Query{Panel: p.Title, RefID: tg.RefID, Expr: strings.TrimSpace(expr)})
		}
	}
	return out, errors.Join(errs...)
}
